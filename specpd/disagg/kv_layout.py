"""Which bytes of whose pages hold which KV, on each side of a handoff, and the runs that move it
(docs/architecture.md §4).

A page of a pool is `[kv_heads, layers, 2, page_size, head_dim]` in memory (specpd/kv/pool.py): one (head,
layer) pair is a block of `block_bytes` (its K and V for the page's positions), and any range of heads is one
contiguous run. Each side describes every registered pool of every rank with a `PoolPlacement`: the model's
heads and layers it holds (layers numbered target first, then the draft's). Under tensor parallelism rank r's
target pool holds heads [r * H / tp, (r + 1) * H / tp) of the target's layers; a draft runs whole on rank 0
(specpd/model/tp.py), so its pool holds every head of the draft's layers, inside the target's pages at TP 1 when
its geometry matches (the page's second block), else a pool of its own.

`plan(src, dst, layers)` maps every (head, layer) of `layers` that D holds to the P rank and pool holding it,
and merges neighbours that are contiguous on both sides into one `Run`: P TP -> D TP moves whole head ranges,
one run per page and overlapping head range of the target's layers, one for the draft's (one for both when the
whole page moves), never per-token slices. A (head, layer) that D expects and P does not hold is a
`LayoutMismatch` naming both sides.
"""
from __future__ import annotations

from specpd.disagg.messages import PoolPlacement
from specpd.disagg.transfer.base import Run


class LayoutMismatch(ValueError):
    """D expects KV that P does not hold (or holds twice): the message names both sides' placements."""


def pool_placements(pool, index: int, head_start: int, layer_start: int) -> list[PoolPlacement]:
    """Registered pool `index` (a KVPool's storage) holds its heads of its layers from byte 0 of a page, then,
    where it keeps room for a draft's layers (`extra_layers`), those heads of the draft's layers."""
    block = 2 * pool.page_size * pool.head_dim * pool.storage.element_size()
    out = [PoolPlacement(index, 0, head_start, pool.kv_heads, layer_start, pool.num_layers, block)]
    if pool.extra_layers:
        out.append(PoolPlacement(index, pool.kv_heads * pool.num_layers * block, head_start, pool.kv_heads,
                                 layer_start + pool.num_layers, pool.extra_layers, block))
    return out


def plan(src: list[tuple[PoolPlacement, ...]], dst: list[tuple[PoolPlacement, ...]],
         layers: range) -> dict[tuple[int, int], list[Run]]:
    """{(P rank, D rank): runs} moving every (head, layer) of `layers` that D holds from where P holds it.

    `src[r]` / `dst[r]`: rank r's placements. Raises LayoutMismatch when P lacks one or holds one twice."""
    blocks: list[tuple[int, int, int, int, int, int, int]] = []  # (src rank, src pool, src off, dst rank, ...)
    for d_rank, placements in enumerate(dst):
        for where in placements:
            for head in range(where.head_start, where.head_start + where.num_heads):
                for layer in range(max(where.layer_start, layers.start),
                                   min(where.layer_start + where.num_layers, layers.stop)):
                    found = [(r, p) for r, ps in enumerate(src) for p in ps if p.holds(head, layer)]
                    if len(found) != 1:
                        raise LayoutMismatch(f"the decode side holds KV head {head} of layer {layer} (rank {d_rank} "
                                             f"pool {where.pool}), which {len(found)} prefill pools hold, not one: "
                                             f"prefill {describe(src)}; decode {describe(dst)}")
                    s_rank, there = found[0]
                    if there.block_bytes != where.block_bytes:
                        raise LayoutMismatch(f"KV block of {there.block_bytes} B on the prefill side, "
                                             f"{where.block_bytes} B on the decode side (page size, head dim, dtype)")
                    blocks.append((s_rank, there.pool, there.offset(head, layer), d_rank, where.pool,
                                   where.offset(head, layer), where.block_bytes))
    runs: dict[tuple[int, int], list[Run]] = {}
    for s_rank, s_pool, s_off, d_rank, d_pool, d_off, size in sorted(blocks):
        out = runs.setdefault((s_rank, d_rank), [])
        last = out[-1] if out else None
        if last is not None and last.src_pool == s_pool and last.dst_pool == d_pool \
                and last.src_offset + last.num_bytes == s_off and last.dst_offset + last.num_bytes == d_off:
            out[-1] = Run(s_pool, last.src_offset, d_pool, last.dst_offset, last.num_bytes + size)
        else:
            out.append(Run(s_pool, s_off, d_pool, d_off, size))
    return runs


def describe(side: list[tuple[PoolPlacement, ...]]) -> str:
    """e.g. "TP 2: rank 0 [heads 0-0 x layers 0-29], rank 1 [heads 1-1 x layers 0-29]"."""
    ranks = [f"rank {r} [" + ", ".join(f"heads {p.head_start}-{p.head_start + p.num_heads - 1} x layers "
                                       f"{p.layer_start}-{p.layer_start + p.num_layers - 1}" for p in pools) + "]"
             for r, pools in enumerate(side)]
    return f"TP {len(side)}: " + ", ".join(ranks)


__all__ = ["LayoutMismatch", "describe", "plan", "pool_placements"]
