"""Tensor parallelism on one host (Megatron's layout): one process per rank; the all-reduces over NCCL on a GPU
(rank r on cuda:r), over gloo on a CPU; gloo for the point-to-point control messages either way.

Rank 0 is the engine's own process: it schedules, keeps the allocator and the caches, samples and verifies, so
nothing that decides runs anywhere else. Ranks 1..N-1 are worker processes holding only their shard of the
decoder and of the KV pool; they run the target forwards rank 0 runs, in the same order, and nothing else.
  - per layer: q/k/v and gate/up are column-parallel (a rank owns a contiguous range of query heads, the KV
    heads they read, and a slice of the MLP's intermediate), o_proj and down_proj row-parallel: one all-reduce
    after each (partial sums; no bias there), so every rank's residual stream is the same tensor;
  - the embedding, the norms and the LM head are replicated; only rank 0 computes logits;
  - the KV pool is sharded by KV head: every rank has the same pages (rank 0's allocator) holding its heads.
A forward's inputs reach the workers over a pipe per worker (pickled ids, positions and attention metadata,
no plan: each rank plans its own backend), and so do the KV slot moves of a verified tree path (`compact_kv`);
the all-reduces over `collective_backend` (a bf16 / fp16 partial sum in fp32). On a GPU rank r holds cuda:r
(`rank_device`; --tp-size past the GPU count is refused at start-up: `check_devices`).
A draft model (EAGLE, EAGLE-3, MTP) is not sharded: it runs whole on rank 0 on the target's replicated
embedding and LM head and on the full hidden states (every rank has the whole residual stream after each
all-reduce), in a KV pool of every head on rank 0, so its KV, top-k and hidden are TP 1's up to the all-reduce's
rounding. A one-layer draft costs a few percent of the target; sharding it would add two all-reduces per draft
step (as many as a target layer) to save little.
PD: every rank of a prefill or decode server has a transfer endpoint of its own with its KV pool registered,
so P's ranks write their heads straight into the D ranks that hold them (specpd/disagg/kv_layout.py,
specpd/disagg/kv_sender.py): rank 0 starts the workers' engines and names their writes through `call` (after
the forwards that computed the KV, on the same pipe), and hears each one's result.
Failure: a worker waits on its pipe, never in a collective, so an idle server has no collective to time out; a
dead worker fails rank 0's next send or collective (RankFailed names the rank) and the server stops
(specpd/server/async_engine.py); a dead rank 0 closes the pipes and the workers exit.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import pickle
import threading
import time
import types

import torch
import torch.distributed as dist
from torch import multiprocessing as mp

from specpd.core import EngineBroken
from specpd.config import EngineConfig, ModelConfig

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


class RankFailed(EngineBroken):
    """A tensor-parallel rank is gone: the group cannot run another forward."""


def check_tp_size(cfg: ModelConfig, tp: int) -> None:
    """ValueError naming the sizes when `tp` ranks cannot split the model's heads and MLP evenly."""
    if tp < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp}")
    if tp > 1 and cfg.moe is not None:  # docs/tensor-parallelism.md: what a rank would hold
        raise ValueError(f"--tp-size {tp} is not supported for {cfg.architecture} (MoE"
                         f"{', multi-head latent attention' if cfg.mla is not None else ''}): serve it with "
                         f"--tp-size 1")
    for name, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                    ("MLP intermediate size", cfg.intermediate_size)):
        if n % tp:
            raise ValueError(f"tp_size {tp} does not divide the model's {n} {name} (a valid size divides "
                             f"{cfg.num_heads} attention heads, {cfg.num_kv_heads} KV heads and "
                             f"{cfg.intermediate_size} intermediate)")


def check_quantization(cfg: ModelConfig, tp: int, method: str) -> None:
    """ValueError naming the sizes when `method`'s quantized weights would not shard into exactly TP 1's.

    int4 quantizes groups of INT4_GROUP consecutive input columns of one output row (specpd.model.quant): a
    row-parallel shard (o_proj, down_proj: input columns split) keeps whole groups when its width is a multiple
    of the group, and a column-parallel one (q/k/v, gate/up: rows split) always does, so every rank holds TP 1's
    codes and scales for its slice. int8 scales each output row by its absmax over every input column, which a
    row-parallel shard splits: those layers take the whole rows' scales (row_parallel_scales) and need no check."""
    from specpd.model.quant import INT4_ROWS, INT4_GROUP
    if method != "int4" or tp == 1:
        return
    d, hq, hkv, inter = cfg.head_dim, cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.intermediate_size // tp
    for name, width, unit in (("o_proj input columns", hq * d, INT4_GROUP),
                              ("down_proj input columns", inter, INT4_GROUP),
                              ("qkv_proj rows", (hq + 2 * hkv) * d, INT4_ROWS),
                              ("gate_up_proj rows", 2 * inter, INT4_ROWS)):
        if width % unit:
            raise ValueError(f"tp_size {tp} with quantization 'int4': a rank's {width} {name} are not a multiple of "
                             f"{unit}, so its shard would not hold whole int4 groups")


def row_parallel_scales(weights: dict[str, torch.Tensor], cfg: ModelConfig, method: str
                        ) -> list[dict[str, torch.Tensor]] | None:
    """int8: every layer's o_proj and down_proj row scales over their whole rows (quant.int8_scale), which each
    rank's column shard quantizes with, so its codes are TP 1's; None for the other methods."""
    if method != "int8":
        return None
    from specpd.model.quant import int8_scale
    return [{name: int8_scale(weights[f"model.layers.{i}.{block}.{name}.weight"])
             for block, name in (("self_attn", "o_proj"), ("mlp", "down_proj"))} for i in range(cfg.num_layers)]


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """What one rank's decoder and KV pool hold: 1/tp of the heads and of the intermediate."""
    check_tp_size(cfg, tp)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=cfg.num_kv_heads // tp,
                               intermediate_size=cfg.intermediate_size // tp)


def shard_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s HF-named weights (views): q/k/v/gate/up rows (and q/k/v bias) of its heads and intermediate
    slice, o_proj/down_proj columns of the same; everything else whole."""
    if tp == 1:
        return weights
    d = cfg.head_dim
    hq, hkv, inter = cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.intermediate_size // tp
    rows = {"q_proj": hq * d, "k_proj": hkv * d, "v_proj": hkv * d, "gate_proj": inter, "up_proj": inter}
    cols = {"o_proj": hq * d, "down_proj": inter}
    out = {}
    for name, w in weights.items():
        parts = name.split(".")
        kind = parts[-2] if len(parts) >= 2 else ""
        if kind in rows:  # weight [out, in] or bias [out]
            n = rows[kind]
            out[name] = w[rank * n:(rank + 1) * n]
        elif kind in cols and parts[-1] == "weight":
            n = cols[kind]
            out[name] = w[:, rank * n:(rank + 1) * n]
        else:
            out[name] = w
    return out


def collective_backend(device: str | torch.device) -> str:
    """The process-group backend of the decoder's all-reduces: NCCL for CUDA tensors, gloo for host ones."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str | torch.device, rank: int) -> torch.device:
    """Where rank `rank` of a group on `device` computes: its own GPU (cuda:rank), or the host."""
    device = torch.device(device)
    return torch.device("cuda", rank) if device.type == "cuda" else device


def check_devices(device: str | torch.device, tp: int, gpus: int | None = None) -> None:
    """ValueError naming both numbers when a CUDA group of `tp` ranks would not have a GPU per rank (gpus: the
    count, default torch's)."""
    if torch.device(device).type != "cuda" or tp == 1:
        return
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if gpus < tp:
        raise ValueError(f"--tp-size {tp} on --device cuda needs a GPU per rank; this machine has {gpus}")


class TPGroup:
    """This rank's groups (not torch.distributed's default group: several engines, e.g. a test's, may each have
    their own in one process): gloo for point-to-point messages, and for the all-reduces the collective backend
    of `device` (NCCL on a GPU, under a prefix of the same store; gloo itself on a CPU)."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: str | torch.device = "cpu"):
        options = dist.ProcessGroupGloo._Options()
        options._timeout = COLLECTIVE_TIMEOUT
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self.group = dist.ProcessGroupGloo(store, rank, size, options)
        self.collectives = self.group
        self.backend = collective_backend(device)
        if self.backend == "nccl":
            nccl = dist.ProcessGroupNCCL.Options()
            nccl._timeout = COLLECTIVE_TIMEOUT
            self.collectives = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, nccl)
        self.rank, self.size = rank, size

    def send(self, x: torch.Tensor, dst: int) -> None:
        try:
            self.group.send([x], dst, 0).wait()
        except RuntimeError as e:
            raise RankFailed(f"tensor-parallel send from rank {self.rank} to rank {dst} failed: {e}") from e

    def recv(self, x: torch.Tensor, src: int) -> None:
        try:
            self.group.recv([x], src, 0).wait()
        except RuntimeError as e:
            raise RankFailed(f"tensor-parallel recv on rank {self.rank} from rank {src} failed: {e}") from e

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (every rank ends with the same bits: gloo reduces each chunk once). A bf16 /
        fp16 partial sum is summed in fp32 and rounded once, as TP 1's GEMM rounds its fp32 accumulator once."""
        wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        try:
            self.collectives.allreduce([wide]).wait()
        except RuntimeError as e:
            raise RankFailed(f"tensor-parallel all-reduce failed on rank {self.rank} of {self.size}: {e}") from e
        if wide is not x:
            x.copy_(wide)
        return x


def attach(model: torch.nn.Module, group: TPGroup) -> None:
    """Make the decoder's row-parallel layers (o_proj, down_proj) all-reduce their output."""
    for layer in model.layers:
        layer.self_attn.tp = group
        layer.mlp.tp = group


def _wire_meta(meta):
    """The metadata a worker needs (its own backend plans it), its tensors on the host (a worker's device is its
    own GPU)."""
    host = {f.name: getattr(meta, f.name).cpu() for f in dataclasses.fields(meta)
            if isinstance(getattr(meta, f.name), torch.Tensor)}
    return dataclasses.replace(meta, plan=None, **host)


def _on_device(meta, device: torch.device):
    """A wired metadata's tensors on this rank's device."""
    return dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(device) for f in dataclasses.fields(meta)
                                        if isinstance(getattr(meta, f.name), torch.Tensor)})


class TPModel:
    """Rank 0's view of the sharded target: calling it sends the forward's inputs to every worker, then runs
    rank 0's shard; every other attribute is the local CausalLM's (compute_logits, embed_tokens, layers...)."""

    def __init__(self, model: torch.nn.Module, group: TPGroup, conns: list, procs: list):
        self.__dict__.update(_model=model, _group=group, _conns=conns, _procs=procs, _closed=False,
                             _calls={}, _next_call=0, _replies=threading.Lock())

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids, positions, backend, meta, capture_layers=()):
        self._send(("forward", input_ids.cpu(), positions.cpu(), _wire_meta(meta), tuple(capture_layers)))
        return self._model(input_ids, positions, backend, meta, capture_layers=capture_layers)

    def compact_kv(self, moves) -> None:
        """The workers apply the KV slot moves rank 0 applied (a verified tree path next to its root)."""
        self._send(("compact_kv", moves))

    # -- calls on one worker (PD: its own transfer engine, specpd/disagg/kv_sender.py)

    def call(self, rank: int, fn, *args) -> "RankCall":
        """Worker `rank` runs fn(state, done, *args) after every forward sent before (fn: a module-level function,
        sent by name; `state`: the worker's namespace with its `rank`, `pool` and what earlier calls kept there).
        fn calls done(value) once, then or later from any thread; the RankCall gets the value."""
        self.__dict__["_next_call"] += 1
        pending = self._calls[self._next_call] = RankCall(self, rank)
        self._send(("call", self._next_call, fn, args), ranks=[rank])
        return pending

    def pump(self) -> None:
        """Deliver the values workers sent back; a dead worker's calls get a RankFailed."""
        with self._replies:
            for conn in self._conns:
                try:
                    while conn.poll(0):
                        cid, value = pickle.loads(conn.recv_bytes())
                        pending = self._calls.pop(cid, None)
                        if pending is not None:
                            pending.value, pending.done = value, True
                except (EOFError, OSError):
                    pass  # the process check below names it
            for cid, pending in list(self._calls.items()):
                proc = self._procs[pending.rank - 1]
                if not proc.is_alive():
                    del self._calls[cid]
                    pending.value, pending.done = RankFailed(
                        f"tensor-parallel rank {pending.rank} exited (code {proc.exitcode}) during a call"), True

    def _send(self, message, ranks=None) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            if ranks is not None and rank not in ranks:
                continue
            if not proc.is_alive():
                raise RankFailed(f"tensor-parallel rank {rank} of {self._group.size} exited (code {proc.exitcode})")
            try:
                conn.send_bytes(data)
            except OSError as e:
                raise RankFailed(f"tensor-parallel rank {rank} of {self._group.size} is gone: {e}") from e

    def dead_ranks(self) -> list[int]:
        return [rank for rank, proc in enumerate(self._procs, start=1) if not proc.is_alive()]

    @property
    def workers(self) -> list:
        return list(self._procs)

    def close(self) -> None:
        """Stop the workers (each exits at its pipe's end); idempotent."""
        if self._closed:
            return
        self.__dict__["_closed"] = True
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
                conn.close()
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


class RankCall:
    """A call's value as rank 0 waits for it (TPModel.call): `done`, then `value`."""

    def __init__(self, tp: TPModel, rank: int):
        self.tp, self.rank = tp, rank
        self.done, self.value = False, None

    def ready(self) -> bool:
        if not self.done:
            self.tp.pump()
        return self.done

    def wait(self, timeout: float | None = None) -> bool:
        """True once the value came, False after `timeout` seconds without it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ready():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True


def rank_threads(config: EngineConfig) -> int:
    """Torch threads of each rank: --num-threads, else the process's default (specpd.machine) split between
    the ranks."""
    from specpd.machine import default_threads
    return config.num_threads or max(1, default_threads() // config.tp_size)


def start_group(config: EngineConfig, hf_config: dict, weights: dict[str, torch.Tensor],
                max_model_len: int, row_scales=None) -> tuple[TPGroup, list, list]:
    """Spawn ranks 1..tp-1 (each builds its shard of the decoder and the KV pool) and join rank 0 to the group;
    returns (group, pipes, processes)."""
    size = config.tp_size
    cfg = ModelConfig.from_hf(hf_config)
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for rank in range(1, size):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, name=f"specpd-tp{rank}", daemon=True,
                           args=(rank, store.port, config, hf_config, shard_weights(weights, cfg, size, rank),
                                 max_model_len, child, row_scales))
        proc.start()
        child.close()
        conns.append(parent)
        procs.append(proc)
    try:
        group = TPGroup(store, 0, size, config.device)
    except RuntimeError as e:
        for proc in procs:
            proc.kill()
        raise RankFailed(f"the tensor-parallel group of {size} did not form: {e}") from e
    return group, conns, procs


def _worker_main(rank: int, store_port: int, config: EngineConfig, hf_config: dict, weights: dict,
                 max_model_len: int, conn, row_scales=None) -> None:
    from specpd.kernels.kv_compact import compact_pool
    from specpd.kv.pool import DTYPES
    from specpd.model.decoder import build_decoder
    torch.set_num_threads(rank_threads(config))
    torch.manual_seed(config.seed)
    device = rank_device(config.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", store_port, config.tp_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    group = TPGroup(store, rank, config.tp_size, device)
    model, pool, backend = build_decoder(config, shard_config(ModelConfig.from_hf(hf_config), config.tp_size),
                                         weights, max_model_len, device, DTYPES[config.dtype], row_scales=row_scales)
    del weights
    attach(model, group)
    state = types.SimpleNamespace(rank=rank, pool=pool)
    replies = threading.Lock()  # a call's value may come from another thread (a transfer engine's)

    def reply(cid: int, value) -> None:
        data = pickle.dumps((cid, value), protocol=pickle.HIGHEST_PROTOCOL)
        with replies:
            conn.send_bytes(data)

    with torch.inference_mode():
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break  # rank 0 is gone
            if message is None:
                break
            if message[0] == "compact_kv":
                compact_pool(pool, message[1])
            elif message[0] == "call":
                _, cid, fn, args = message
                fn(state, functools.partial(reply, cid), *args)
            else:
                _, input_ids, positions, meta, capture = message
                meta = backend.plan(_on_device(meta, device))
                model(input_ids.to(device), positions.to(device), backend, meta, capture_layers=capture)
    for close in getattr(state, "on_exit", ()):
        close()
