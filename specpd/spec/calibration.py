"""The adaptive policy's cost model, measured at startup on this machine (CostModel, cost.py).

1. Target forwards over 1..64 rows of one request (`context` tokens cached), LM head on every row: the
   grid's points are timed in passes, every point once per pass, so the box's drift between passes falls on
   every point alike; each point keeps its fastest pass. Where the packed CPU kernel runs the decoder's
   matmuls, the table is completed at every row count from the matmuls timed there (`with_matmul_steps`).
2. The same over `batch` requests: one row each (the per-request cost) and two rows each (`tree_factor`:
   padded multi-row attention with tree masks, which one request's rows do not show).
3. Draft forwards (+ head, softmax, top-k) by rows, for drafters with a model, and draft extends by rows (the
   head on the last row alone, as a catch-up and a round's extend run: CostModel.extend).
Scratch pages come from the engine's allocator and go back to it.
The clock (`calibration_clock`): with one torch thread every forward runs on the calling thread, so its CPU
time is the forward's cost whatever else the box runs; wall time is not. The two servers of a 1P1D cluster
start together on the same few cores (each loading, then calibrating), and other work may share the cores: on
a loaded box, decode servers' wall-clock tables differed start to start in level and in shape (a flat one
prices verify rows as free), where thread CPU time read the same level and shape in every start (issue 31).
The table's level is the online scale's to
correct (cost.py); its shape is what a decision reads. With several threads a forward's work is spread
over threads this one cannot see, so wall time it is (a busy box then still bends the table).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from specpd.spec.cost import CostModel
from specpd.kv.allocator import pages_needed

TARGET_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
DRAFT_GRID = (1, 2, 4, 8, 16, 32, 64)
EXTEND_GRID = (1, 4, 16, 64)
BATCH = 8


def calibration_clock() -> tuple[str, Callable[[], float]]:
    """(name, clock) the table is timed with: this thread's CPU time when torch runs on this thread alone."""
    if torch.get_num_threads() == 1:
        return "thread_cpu", time.thread_time
    return "wall", time.perf_counter


def fastest(fns: dict, passes: int, clock: Callable[[], float] = time.perf_counter) -> dict:
    """key -> the fastest of `passes` timed calls of fns[key], the keys interleaved in every pass (after one
    warm-up call each)."""
    for fn in fns.values():
        fn()
    best = {k: float("inf") for k in fns}
    for _ in range(passes):
        for k, fn in fns.items():
            t0 = clock()
            fn()
            best[k] = min(best[k], clock() - t0)
    return best


@torch.inference_mode()
def calibrate(spec_runner, context: int = 128, passes: int = 3) -> CostModel:
    """Time target forwards by rows and by requests, and draft forwards by rows (module docstring)."""
    from specpd.spec.draft.eagle_proposer import EagleProposer
    from specpd.spec.draft.hybrid import HybridProposer
    runner, pool = spec_runner.runner, spec_runner.runner.kv_pool
    clock_name, clock = calibration_clock()
    page_size, alloc = pool.page_size, pool.allocator
    # use at most half the free pages: shrink the cached context, then the largest row count
    avail = (alloc.num_free // 2) * page_size
    context = max(1, min(context, avail // (2 * BATCH) - 1))
    grid = [g for g in TARGET_GRID if context + g <= avail]
    per_req_pages = pages_needed(context + 2, page_size)
    big_pages = pages_needed(context + grid[-1], page_size)
    need = max(big_pages, BATCH * per_req_pages)
    if len(grid) < 2 or need > alloc.num_free:
        raise RuntimeError(f"adaptive speculation needs more free KV pages ({alloc.num_free} free) to "
                           f"measure its cost model")
    pages = alloc.alloc(need)
    vocab = runner.model_config.vocab_size
    try:
        def target(rows: int, requests: int):
            q = [rows] * requests
            kv = [context + rows] * requests
            lists = [pages[:big_pages]] if requests == 1 else \
                [pages[i * per_req_pages:(i + 1) * per_req_pages] for i in range(requests)]
            n = rows * requests
            ids = [(7 * i) % vocab for i in range(n)]
            pos = [context + (i % rows) for i in range(n)]
            return lambda: spec_runner._target_forward(ids, pos, q, kv, lists, [None] * requests, list(range(n)))

        target(grid[-1], 1)()  # first-call costs out of the table
        fns = {("rows", r): target(r, 1) for r in grid}
        fns[("batch", 1)], fns[("batch", 2)] = target(1, BATCH), target(2, BATCH)
        t = fastest(fns, passes, clock)
        target_rows = monotone(with_matmul_steps(runner.model, {r: t["rows", r] for r in grid}, passes, clock))
        per_request = max(0.0, (t["batch", 1] - target_rows[min(BATCH, grid[-1])]) / (BATCH - 1))
        # BATCH requests of 2 rows each against the table's price for their rows (CostModel.tree_factor)
        tree_rows = min(2 * BATCH, grid[-1])
        modelled = target_rows[tree_rows] - target_rows[BATCH] if tree_rows in target_rows else 0.0
        tree_factor = 1.0
        if modelled > 0:
            tree_factor = min(4.0, max(1.0, (t["batch", 2] - t["batch", 1]) / modelled))
        draft_rows = extend_rows = None
        proposer = spec_runner.proposer
        if isinstance(proposer, (EagleProposer, HybridProposer)):
            model = proposer if isinstance(proposer, EagleProposer) else proposer.model
            hid = model.draft.config.hidden_size

            def draft(r: int, extend: bool):
                ids = [(7 * i) % vocab for i in range(r)]
                pos = [context + i for i in range(r)]
                hidden = torch.zeros(r, hid, dtype=pool.dtype, device=runner.device)
                step = 0 if extend else 1
                return lambda: model._topk(model._run(ids, hidden, pos, [r], [context + r], [pages[:big_pages]],
                                                      step=step, last_only=extend), step=step)
            fns = {("draft", r): draft(r, False) for r in DRAFT_GRID if r <= grid[-1]}
            fns.update({("extend", r): draft(r, True) for r in EXTEND_GRID if r <= grid[-1]})
            t = fastest(fns, passes, clock)
            draft_rows = monotone({r: s for (kind, r), s in t.items() if kind == "draft"})
            extend_rows = monotone({r: s for (kind, r), s in t.items() if kind == "extend"})
    finally:
        alloc.free(pages)
    return CostModel(target_rows, per_request, draft_rows, tree_factor=tree_factor, clock=clock_name,
                     extend_rows=extend_rows)


def with_matmul_steps(model, table: dict[int, float], passes: int,
                      clock: Callable[[], float] = time.perf_counter) -> dict[int, float]:
    """The target's cost at every row count up to the table's last, on CPU: a GEMM library's cost steps where
    its row blocking changes, and a sparse grid's interpolation misses the steps, which is what speculating at
    batch 8 pays. Each count's value: the forward's interpolation plus how far the matmuls at that count (one
    decoder layer's, timed, times the layer count) lie from their own interpolation over the same grid."""
    from specpd.spec.cost import PiecewiseLinear
    layer = model.layers[0]
    # a layer without these (an MLA or MoE layer, specpd/model/moe_lm.py) keeps the table as measured
    linears = [getattr(layer.self_attn, "qkv_proj", None), getattr(layer.self_attn, "o_proj", None),
               getattr(layer.mlp, "gate_up_proj", None), getattr(layer.mlp, "down_proj", None)]
    dtype = layer.input_layernorm.weight.dtype
    if layer.input_layernorm.weight.device.type != "cpu" or not all(hasattr(m, "in_features") for m in linears):
        return table
    top = max(table)

    def layer_matmuls(rows: int):
        xs = [(m, torch.randn(rows, m.in_features).to(dtype)) for m in linears]
        return lambda: [m(x) for m, x in xs]
    t = fastest({r: layer_matmuls(r) for r in range(1, top + 1)}, passes, clock)
    matmul = {r: len(model.layers) * s for r, s in t.items()}
    grid = PiecewiseLinear({r: matmul[r] for r in table})
    forward = PiecewiseLinear(table)
    # a step is a deviation of the matmuls alone: it can halve nothing (on a tiny model the matmuls are
    # microseconds, and their noise must not drive a row's price to zero or below)
    return {r: max(0.5 * forward(r), forward(r) + matmul[r] - grid(r)) for r in range(1, top + 1)}


def monotone(table: dict[int, float]) -> dict[int, float]:
    """More rows never cost less: a noisy high reading at few rows is cut to the cheapest after it."""
    out, low = {}, float("inf")
    for rows in sorted(table, reverse=True):
        low = min(low, table[rows])
        out[rows] = low
    return dict(sorted(out.items()))
