"""CUDA graphs for the decoder's decode and verify forwards and the draft's extend and step forwards.

A GPU step of a small model is launch-bound: ~10 kernels a layer and the Python between them. A graph replays a
forward's kernels in one launch. A forward replayed from a graph, per call of `GraphRunner.run`:
  1. Shape: the smallest bucket of requests (1, 2, 4, then every 8 up to --cuda-graph-max-bs) and the smallest
     width of query rows per request (the runner's widths: 1 for decode, the tree's nodes for verify, the draft's
     frontier for its steps) that hold the batch. A batch that fits none (more requests, a prefill chunk) runs
     eagerly, as it always did: `run` returns None.
  2. Layout (specpd/attention/static.py `pad_layout`): the batch padded to bucket x width rows. Pad rows write
     their K/V to the scratch slot (a page taken from the allocator at start-up, never a request's) and no real
     row sees them.
  3. Static buffers, allocated once at the largest bucket: input ids, positions, the draft's input hidden and the
     attention metadata (`StaticMetadata`), the batch copied into a prefix of each. The backend's `plan_static`
     plans into buffers of its own.
  4. The first time a shape is seen: on CUDA, two warm-up forwards on a side stream (Triton compiles there),
     then the forward captured into a graph sharing one memory pool with the others; without capture
     (`capture=False`: the CPU tests), nothing.
  5. Replay (or, without capture, the forward run eagerly on the same static buffers: exactly the path a graph
     records), then the real rows gathered into fresh tensors (a later replay overwrites the graph's outputs).
`check_config` refuses at start-up what cannot run: graphs off the GPU, under tensor parallelism or with a
backend that cannot plan into static buffers, and a tree-shaped speculative configuration with a backend that
has no tree masks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specpd.attention.base import get_backend_class
from specpd.attention.static import PaddedLayout, StaticMetadata, pad_layout
from specpd.model.llama import OutputRows

# forward(ids [N], positions [N], meta, hidden [N, H_in] | None, rows | None, variant) -> outputs, rows first
Forward = Callable[..., tuple[torch.Tensor, ...]]


def buckets(max_bs: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, then every 8 (vLLM's), and max_bs itself."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs, 8))
    return sorted(set(sizes + [max_bs]))


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding n requests, None past the largest."""
    return next((b for b in sizes if b >= n), None)


@dataclass(frozen=True)
class GraphKey:
    """What decides a captured graph's work: its shape and what the forward does differently."""

    bucket: int
    width: int  # query rows per request
    mask_width: int  # tree block columns per request, 0: causal
    variant: tuple = ()  # the input hidden's width, last rows only, the draft's step / the captured layers


@dataclass
class _Graph:
    outputs: tuple[torch.Tensor, ...]  # the forward's outputs (a graph's: rewritten by every replay)
    graph: object = None  # torch.cuda.CUDAGraph, None without capture


@dataclass
class GraphSettings:
    """What the target's and the draft's graph runners share (one engine: one scratch page, one memory pool)."""

    max_bs: int
    capture: bool
    scratch_page: int
    max_pages: int  # page table columns: the longest KV a graph can hold
    mempool: object = None  # torch.cuda.graph_pool_handle(): every graph of the engine allocates from it

    def runner(self, forward: Forward, backend, widths: list[int], max_mask_cells: int) -> "GraphRunner":
        """A graph runner of `forward` (rows per request: `widths`; tree-mask entries per request at most
        max_mask_cells) sharing these settings."""
        return GraphRunner(forward, backend, self, widths, max_mask_cells)


class GraphRunner:
    """One forward (the target's or the draft's) over static buffers, per shape a graph (module docstring)."""

    def __init__(self, forward: Forward, backend, settings: GraphSettings, widths: list[int], max_mask_cells: int):
        self.forward, self.backend, self.settings = forward, backend, settings
        self.widths = sorted(set(widths))
        self.buckets = buckets(settings.max_bs)
        pool = backend.kv_pool
        self.device = pool.buffer.device
        self.page_size = pool.page_size
        max_bs, max_w = settings.max_bs, self.widths[-1]
        self.max_kv_len = settings.max_pages * pool.page_size
        self.static = StaticMetadata(max_bs, max_w, settings.max_pages, max_mask_cells, pool.page_size, self.device)
        self.static_rows = StaticMetadata(max_bs, 1, settings.max_pages, 0, pool.page_size, self.device)
        long = dict(dtype=torch.int64, device=self.device)
        self.ids = torch.zeros(max_bs * max_w, **long)  # [max_bs * max_width]
        self.positions = torch.zeros(max_bs * max_w, **long)
        self.rows_index = torch.zeros(max_bs, **long)  # [max_bs] OutputRows' rows
        self.hidden: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # [max_bs * max_width, H_in] per width
        self._graphs: dict[GraphKey, _Graph] = {}

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def layout(self, q_lens, kv_lens, page_lists, tree_masks=None) -> PaddedLayout | None:
        """The batch in its graph's shape, or None: it runs eagerly."""
        bucket = bucket_for(len(q_lens), self.buckets)
        width = next((w for w in self.widths if w >= max(q_lens)), None)
        if bucket is None or width is None:
            return None
        layout = pad_layout(q_lens, kv_lens, page_lists, tree_masks, bucket, width, self.page_size,
                            self.settings.max_pages, self.settings.scratch_page)
        return layout if layout is not None and self.static.fits(layout) else None

    def run(self, ids: list[int], positions: list[int], q_lens: list[int], kv_lens: list[int],
            page_lists: list[list[int]], tree_masks=None, hidden: torch.Tensor | None = None,
            last_only: bool = False, variant: tuple = ()) -> tuple[torch.Tensor, ...] | None:
        """The forward's outputs at the batch's rows ([sum q_lens, ...] each; last_only: [len(q_lens), ...] at each
        request's last row, where the forward computed only those), or None where no graph fits the batch."""
        layout = self.layout(q_lens, kv_lens, page_lists, tree_masks)
        if layout is None:
            return None
        n_rows = layout.bucket * layout.width
        hidden_key = None if hidden is None else (hidden.shape[-1], hidden.dtype)
        key = GraphKey(layout.bucket, layout.width, layout.mask_width, (hidden_key, last_only, *variant))
        real = torch.tensor(layout.real_rows, dtype=torch.int64)
        _scatter(self.ids[:n_rows], real, ids)
        _scatter(self.positions[:n_rows], real, positions)
        if hidden is not None:
            buf = self.hidden.get(hidden_key)
            if buf is None:
                buf = self.hidden[hidden_key] = torch.zeros(self.ids.shape[0], hidden.shape[-1], dtype=hidden.dtype,
                                                            device=self.device)
            buf[:n_rows].index_copy_(0, real.to(self.device), hidden)
            hidden = buf[:n_rows]
        meta = self.backend.plan_static(self.static.load(layout), self.max_kv_len)
        rows = None
        if last_only:
            self.rows_index[:layout.bucket].copy_(torch.tensor(layout.last_rows), non_blocking=True)
            rows_meta = self.backend.plan_static(self.static_rows.load_last_rows(layout), self.max_kv_len)
            rows = OutputRows(self.rows_index[:layout.bucket], rows_meta)
        args = (self.ids[:n_rows], self.positions[:n_rows], meta, hidden, rows, variant)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(args) if self.settings.capture else _Graph(())
        if graph.graph is not None:
            graph.graph.replay()
            outputs = graph.outputs
        else:
            outputs = self.forward(*args)
        if last_only:
            return tuple(o[:len(q_lens)].clone() for o in outputs)
        if layout.real_rows == list(range(len(layout.real_rows))):  # one row each, in order: a prefix
            return tuple(o[:len(layout.real_rows)].clone() for o in outputs)
        index = real.to(self.device)
        return tuple(o.index_select(0, index) for o in outputs)

    def _capture(self, args) -> _Graph:
        """Warm up on a side stream (Triton compiles, the allocator settles), then record the forward."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward(*args)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.settings.mempool):
            outputs = self.forward(*args)
        return _Graph(tuple(outputs), graph)


def _scatter(dst: torch.Tensor, rows: torch.Tensor, values: list[int]) -> None:
    """dst[rows] = values, the other rows 0 (token 0 at position 0: a valid embedding and RoPE row)."""
    host = torch.zeros(dst.shape[0], dtype=dst.dtype)
    host[rows] = torch.tensor(values, dtype=dst.dtype)
    dst.copy_(host, non_blocking=True)


def graphs_on(config) -> bool:
    """Whether the engine replays from graphs: --cuda-graphs if given (check_config refuses what cannot), else on
    for a CUDA device at TP 1 with a backend that plans into static buffers (an explicit flashinfer: off)."""
    if config.cuda_graphs is not None:
        return config.cuda_graphs
    return config.graphs and get_backend_class(config.attention_backend).static_plan


def check_config(config) -> None:
    """Refuse at start-up, naming both settings, a configuration the engine could not run (module docstring).
    `config`: a resolved EngineConfig."""
    backend = get_backend_class(config.attention_backend)
    spec = config.spec
    if spec.enabled and (spec.topk > 1 or spec.hybrid) and not backend.tree_masks:
        raise ValueError(f"--attention-backend {config.attention_backend} has no tree masks, which "
                         f"--speculative-algorithm {spec.speculative_algorithm} drafts trees with (--spec-topk "
                         f"{spec.topk}{', hybrid n-gram candidates' if spec.hybrid else ''}): choose "
                         f"--attention-backend triton, or a chain (--spec-topk 1 --no-spec-ngram)")
    if not graphs_on(config):
        return
    if config.cuda_graph_max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {config.cuda_graph_max_bs}")
    if torch.device(config.device).type != "cuda" and not config.cuda_graph_eager:
        raise ValueError(f"--cuda-graphs needs --device cuda (got --device {config.device}); use --no-cuda-graphs")
    if config.tp_size != 1:
        raise ValueError(f"--cuda-graphs runs at --tp-size 1 only (got --tp-size {config.tp_size}); use "
                         f"--no-cuda-graphs with tensor parallelism")
    if not backend.static_plan:
        raise ValueError(f"--cuda-graphs needs an attention backend that plans into static buffers (triton, "
                         f"torch); --attention-backend {config.attention_backend} cannot: use --no-cuda-graphs or "
                         f"--attention-backend triton")


def graph_settings(config, kv_pool, max_model_len: int, decode_width: int) -> GraphSettings | None:
    """The engine's graph settings (None: graphs off). Takes the scratch page off the allocator for good.
    decode_width: KV slots a decode round reserves past the committed length."""
    if not graphs_on(config):
        return None
    capture = not config.cuda_graph_eager
    max_pages = -(-(max_model_len + decode_width) // kv_pool.page_size)
    mempool = torch.cuda.graph_pool_handle() if capture else None
    return GraphSettings(config.cuda_graph_max_bs, capture, kv_pool.allocator.alloc(1)[0], max_pages, mempool)
