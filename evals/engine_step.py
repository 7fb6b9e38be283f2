"""Where one engine step's time goes, against the floor of reading its weights and KV (issue: an engine core as
fast as the peer's).

For the default model in the configuration `specpd serve` picks on this machine (dtype, threads, attention
backend: specpd.machine), at batch 1 and 8, for a plain decode step and a verify step (an 8-node tree per
request), with a ~300-token context per request on scattered pages:
  - floor: the bytes one step must read (every linear weight and the LM head once, each request's K/V once) over
    the memory read bandwidth measured on this box at the same thread count, read once just before each timed
    step: each step is set against the floor of its own moment, and the case reports the median ratio with its
    10-90% range (`ReadProbe`);
  - the engine's step: a real `engine.step()` (scheduler, forward, sampling, postprocess, detokenizer) for
    decode; a runner-level forward + LM head + argmax for verify;
  - inside the forward, timed by wrapping each part (perf_counter, interleaved steps): GEMMs (every packed
    linear incl. the LM head), attention (the fused kernel call incl. RoPE and the KV write), norms, and the
    rest (residual adds, activations, embedding, Python between ops); outside it, sampling and the engine's
    own bookkeeping (scheduler, postprocess, detokenizer). Where the C stack runs the layers (bf16 on an
    AVX512-BF16 CPU, fp32 on an AVX-512 one, specpd/model/cpu_stack.py) no part is visible from Python: the case
    then holds the step and forward as served, and `per_layer_python_path` the same case on the per-layer path
    with its parts;
  - with --server: a real `specpd serve` with its defaults, one streamed request (96 tokens, greedy,
    ignore_eos): its TPOT minus the engine step is HTTP, the event loop and the stream;
  - the peer's TPOT at concurrency 1 from evals/results/peers.json when that file exists.

    .venv/bin/python -m evals.engine_step [--server]      → evals/results/engine_step.json
    .venv/bin/python -m evals.engine_step --model-shape llama-1b --batches 1 --dtype float32
                                                          → evals/results/engine_step_llama-1b.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections import defaultdict

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch

from evals.harness.results import REPO_ROOT, log, machine_info, versions, write_json
from evals.peers_servers import SHAPES, random_hf_dir
from specpd.attention.metadata import AttentionMetadata
from specpd.config import CacheConfig, EngineConfig
from specpd.core import SamplingParams
from specpd.engine.llm_engine import LLMEngine
from specpd.kernels import cpu_gemm_bf16
from specpd.machine import isa, wait_for_collapse

OUT = os.path.join(REPO_ROOT, "evals", "results", "engine_step.json")
CTX = 300
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4]  # an 8-node tree (node 0 = root)


class ReadProbe:
    """Bytes per second this box reads from a buffer far larger than the caches: the faster of torch summing an
    fp32 buffer and (AVX512-BF16 CPUs) specpd's bf16 GEMM kernel multiplying one row by a bf16 weight of the
    same size, which streams ~10% faster than torch's sum here. The faster read gives the lower, stricter floor.
    `median()` reads each probe 5 times; `once()` reads the faster one once, just before each timed step, so each
    step is paired with the bandwidth of its own moment (the box's moves with its neighbours' load: 27-61 GB/s in
    one session, and a before/after pair can straddle a change)."""

    def __init__(self, threads: int, mib: int = 1024):
        self.threads, self.nbytes = threads, mib * 2**20
        buf = torch.ones(self.nbytes // 4, dtype=torch.float32)
        self.probes = {"sum": lambda: buf.sum()}
        if cpu_gemm_bf16.available():
            weight = torch.ones(self.nbytes // 2 // 4096, 4096, dtype=torch.bfloat16)
            packed, row = cpu_gemm_bf16.pack(weight), torch.ones(1, 4096, dtype=torch.bfloat16)
            del weight
            self.probes["gemv"] = lambda: cpu_gemm_bf16.gemm(row, packed, None, packed.shape[0] * 16)
        self.fastest = self.probes["sum"]

    def _read(self, probe) -> float:
        t0 = time.perf_counter()
        probe()
        return self.nbytes / (time.perf_counter() - t0)

    def median(self) -> float:
        torch.set_num_threads(self.threads)
        best = 0.0
        for probe in self.probes.values():
            probe()
            rate = statistics.median(self._read(probe) for _ in range(5))
            if rate > best:
                best, self.fastest = rate, probe
        return best

    def once(self) -> float:
        torch.set_num_threads(self.threads)
        return self._read(self.fastest)


def step_bytes(engine: LLMEngine, batch: int, ctx: int) -> int:
    """Weights every step reads (every linear + the LM head; the embedding rows are negligible) + K/V."""
    model = engine.runner.model
    elem = torch.tensor([], dtype=engine.runner.dtype).element_size()
    weights = 0
    for m in model.modules():
        if hasattr(m, "in_features") and hasattr(m, "out_features"):
            weights += m.in_features * m.out_features * elem
    if model.packed_head is not None or model.lm_head is None:
        weights += model.config.vocab_size * model.config.hidden_size * elem
    mc = engine.model_config
    kv = batch * ctx * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * elem
    return weights + kv


class Timers:
    """Wall seconds spent in wrapped callables, by category (outermost call only per category)."""

    def __init__(self):
        self.total = defaultdict(float)
        self._depth = defaultdict(int)
        self._undo = []

    def wrap(self, owner, name: str, category: str) -> None:
        orig = getattr(owner, name)
        timers = self

        def wrapped(*args, **kwargs):
            if timers._depth[category]:
                return orig(*args, **kwargs)
            timers._depth[category] += 1
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                timers.total[category] += time.perf_counter() - t0
                timers._depth[category] -= 1
        setattr(owner, name, wrapped)
        self._undo.append((owner, name, orig))

    def restore(self) -> None:
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)
        self._undo.clear()

    def reset(self) -> None:
        self.total.clear()


def instrument(engine: LLMEngine) -> Timers:
    import specpd.attention.cpu_backend as cpu_backend
    import specpd.kernels.cpu_linear as cpu_linear
    import specpd.model.llama as llama
    import specpd.model.runner as runner
    t = Timers()
    t.wrap(cpu_linear.PackedLinear, "forward", "gemm")
    t.wrap(cpu_backend.CpuAttentionBackend, "attend", "attention")
    t.wrap(llama.RMSNorm, "forward", "norms")
    t.wrap(llama.CausalLM, "forward", "forward")
    t.wrap(runner.ModelRunner, "execute", "execute")
    t.wrap(runner.ModelRunner, "sample_items", "lm head + sampling")
    return t


def make_engine(batch: int, dtype: str | None = None, model: str = "default") -> LLMEngine:
    pages = batch * (-(-(CTX + 200) // 16)) + 8
    extra = {"dtype": dtype} if dtype else {}
    return LLMEngine(EngineConfig(model=model, cache=CacheConfig(num_pages=pages),
                                  scheduler=EngineConfig().scheduler, **extra))


@torch.inference_mode()
def decode_steps(engine: LLMEngine, batch: int, steps: int, timers: Timers, probe: ReadProbe) -> dict:
    """engine.step() over `batch` requests decoding after a CTX-token prompt: per-step medians by category."""
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(100, vocab - 100, (CTX,), generator=gen).tolist(), params)
    while any(r.num_computed_tokens < CTX for r in engine.scheduler.running + list(engine.scheduler.waiting)) \
            or not engine.scheduler.running:
        engine.step()  # the prompts' prefill
    for _ in range(3):
        engine.step()
    per = defaultdict(list)
    for _ in range(steps):
        per["bandwidth"].append(probe.once())
        timers.reset()
        t0 = time.perf_counter()
        engine.step()
        per["step"].append(time.perf_counter() - t0)
        for k, v in timers.total.items():
            per[k].append(v)
    for i in range(batch):
        engine.abort_request(f"r{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return summarize(per)


@torch.inference_mode()
def verify_steps(engine: LLMEngine, batch: int, steps: int, timers: Timers, probe: ReadProbe) -> dict:
    """A forward over an 8-node tree per request (+ LM head and argmax on every row), scattered pages."""
    runner = engine.runner
    alloc = runner.kv_pool.allocator
    pages_per = -(-(CTX + 8) // 16)
    pages = [alloc.alloc(pages_per) for _ in range(batch)]
    n = len(TREE_PARENTS)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(TREE_PARENTS):
        mask[i, i] = True
        j = p
        while j >= 0:
            mask[i, j] = True
            j = TREE_PARENTS[j]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(100, 40000, (batch * n,), generator=gen)
    depth = [0] * n
    for i, p in enumerate(TREE_PARENTS):
        depth[i] = 0 if p < 0 else depth[p] + 1
    positions = torch.tensor([CTX + depth[i] for _ in range(batch) for i in range(n)])
    per = defaultdict(list)
    try:
        for s in range(steps + 3):
            bandwidth = probe.once() if s >= 3 else None  # read before the timed steps only
            timers.reset()
            t0 = time.perf_counter()
            meta = AttentionMetadata.build([n] * batch, [CTX + n] * batch, pages, 16, tree_masks=[mask] * batch)
            runner.backend.plan(meta)
            hidden, _ = runner.model(ids, positions, runner.backend, meta)
            runner.model.compute_logits(hidden).argmax(dim=-1).tolist()
            if s >= 3:
                per["step"].append(time.perf_counter() - t0)
                per["bandwidth"].append(bandwidth)
                for k, v in timers.total.items():
                    per[k].append(v)
    finally:
        for p in pages:
            alloc.free(p)
    return summarize(per)


def summarize(per: dict) -> dict:
    med = {k: 1000 * statistics.median(v) for k, v in per.items() if k != "bandwidth"}
    fwd = med.get("forward", 0.0)
    out = {"step_ms": med["step"], "forward_ms": fwd, "gemm_ms": med.get("gemm", 0.0),
           "attention_ms": med.get("attention", 0.0), "norms_ms": med.get("norms", 0.0)}
    lm = med.get("lm head + sampling")
    # the LM head is a packed linear too: the forward's gemm excludes it, the step's includes it
    out["rest_of_forward_ms"] = fwd - out["attention_ms"] - out["norms_ms"] - min(out["gemm_ms"], fwd)
    if lm is not None:
        out["lm_head_and_sampling_ms"] = lm
        out["engine_bookkeeping_ms"] = med["step"] - med.get("execute", med["step"])
    out = {k: round(v, 3) for k, v in out.items()}
    out["pairs"] = list(zip(per["step"], per["bandwidth"]))  # (step s, its probe's B/s); `against_floor` reads them
    return out


def against_floor(case: dict, nbytes: int) -> dict:
    """Each timed step over the floor of its own moment (its bytes over the bandwidth read just before it):
    the median ratio with its spread, and the median bandwidth and floor."""
    pairs = case.pop("pairs")
    ratios = sorted(step * bw / nbytes for step, bw in pairs)
    bw = statistics.median(b for _, b in pairs)
    return {"bytes_read_mb": round(nbytes / 2**20, 1), "read_bandwidth_gbs": round(bw / 1e9, 2),
            "read_bandwidth_gbs_range": [round(min(b for _, b in pairs) / 1e9, 1),
                                         round(max(b for _, b in pairs) / 1e9, 1)],
            "floor_ms": round(1000 * nbytes / bw, 3), "step_over_floor": round(statistics.median(ratios), 2),
            "step_over_floor_range": [round(ratios[len(ratios) // 10], 2), round(ratios[-1 - len(ratios) // 10], 2)],
            "paired_steps": len(ratios)}


def server_tpot() -> dict | None:
    """One streamed request to a real `specpd serve --model default` (its defaults): TPOT p50."""
    import httpx

    from specpd.server.launch import serve_processes
    with serve_processes([["--model", "default", "--log-level", "warning"]], 600) as [(_, base, _)]:
        info = httpx.get(base + "/server_info").json()
        body = {"model": "default", "prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 96,
                "temperature": 0, "ignore_eos": True, "stream": True}
        gaps = []
        for _ in range(2):
            stamps = []
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=300) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        stamps.append(time.perf_counter())
            gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
        return {"tpot_p50_ms": round(1000 * statistics.median(gaps), 3), "runtime": info.get("runtime")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--server", action="store_true", help="also time a real server's TPOT (HTTP and streaming)")
    ap.add_argument("--dtype", default=None, help="the engine's dtype (default: what `specpd serve` picks here)")
    ap.add_argument("--model-shape", default="default", choices=("default", *SHAPES),
                    help="another model's shape with random weights on SmolLM2's tokenizer (evals/peers_servers.py: "
                         "speed does not depend on the values), as evals/peers.py runs it")
    ap.add_argument("--out", default=None, help="default: evals/results/engine_step.json (engine_step_<shape>.json)")
    args = ap.parse_args()
    shape = args.model_shape
    model = "default" if shape == "default" else random_hf_dir(shape)
    out = args.out or (OUT if shape == "default" else OUT.replace(".json", f"_{shape}.json"))
    result = {"meta": {"machine": machine_info(), "isa": isa(), "versions": versions(), "context_tokens": CTX,
                       "model_shape": shape,
                       "command": "python -m evals.engine_step" + (" --server" if args.server else "")
                       + (f" --dtype {args.dtype}" if args.dtype else "")
                       + (f" --model-shape {shape} --batches {' '.join(map(str, args.batches))}"
                          if shape != "default" else "") + (f" --steps {args.steps}" if args.steps != 20 else "")},
              "cases": {}}
    for batch in args.batches:
        engine = make_engine(batch, args.dtype, model)
        wait_for_collapse()
        runtime = engine.runner.runtime_info()
        result["meta"]["runtime"] = runtime
        timers = instrument(engine)
        try:
            probe = ReadProbe(runtime["num_threads"])
            probe.median()  # picks the faster probe
            for kind, fn in (("decode", decode_steps), ("verify_tree8", verify_steps)):
                torch.set_num_threads(runtime["num_threads"])
                stack = engine.runner.model.cpu_stack
                case = fn(engine, batch, args.steps, timers, probe)  # as served: the C stack where it runs
                nbytes = step_bytes(engine, batch, CTX)
                floor = against_floor(case, nbytes)
                if stack is not None:  # its layers are one C call: the parts come from the per-layer path
                    engine.runner.model.cpu_stack = None
                    try:
                        python = fn(engine, batch, args.steps, timers, probe)
                    finally:
                        engine.runner.model.cpu_stack = stack
                    python["step_over_floor"] = against_floor(python, nbytes)["step_over_floor"]
                    case = {"step_ms": case["step_ms"], "forward_ms": case["forward_ms"],
                            **{k: v for k, v in case.items() if k in ("lm_head_and_sampling_ms",
                                                                       "engine_bookkeeping_ms")},
                            "per_layer_python_path": python}
                case.update({"rows": batch * (1 if kind == "decode" else len(TREE_PARENTS)), **floor})
                result["cases"][f"b{batch}/{kind}"] = case
                log(f"b{batch}/{kind}", case)
        finally:
            timers.restore()
        del engine
    if args.server:
        result["server"] = server_tpot()
        log("server", result["server"])
    name = "peers.json" if shape == "default" else f"peers_{shape}.json"
    peers = os.path.join(REPO_ROOT, "evals", "results", name)
    if os.path.exists(peers):
        with open(peers, encoding="utf-8") as f:
            result["peers_file"] = f"evals/results/{name}"
            result["peers_summary"] = json.load(f).get("summary")
    write_json(out, result)
    log("wrote", out)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
