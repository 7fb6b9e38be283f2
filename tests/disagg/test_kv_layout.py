"""kv_layout.plan: P's TP -> D's TP moves whole head ranges (one run per page and overlapping head range), and the
runs put every KV byte D holds where TP 1 would have it; a pair that does not fit is refused naming both sides."""
import pytest
import torch

from specpd.disagg.kv_layout import LayoutMismatch, plan, pool_placements
from specpd.kv.pool import KVPool

HEADS, TARGET_LAYERS, DRAFT_LAYERS, PAGE, DIM, PAGES = 12, 3, 1, 4, 8, 6


def side(tp: int, mode: str) -> list[list[tuple[KVPool, int, int]]]:
    """A server's registered pools per rank as kv_sender builds them, each with its first head and layer: rank
    r's target heads (at TP 1 with room for the draft's layers in its pages), and at TP > 1 rank 0's own draft
    pool (every head), draft-on-both."""
    heads = HEADS // tp
    extra = DRAFT_LAYERS if tp == 1 and mode == "both" else 0
    ranks = [[(KVPool(PAGES, TARGET_LAYERS, PAGE, heads, DIM, torch.float32, extra_layers=extra), r * heads, 0)]
             for r in range(tp)]
    if mode == "both" and tp > 1:
        ranks[0].append((KVPool(PAGES, DRAFT_LAYERS, PAGE, HEADS, DIM, torch.float32), 0, TARGET_LAYERS))
    return ranks


def placements(ranks) -> list[tuple]:
    return [tuple(p for i, (pool, head, layer) in enumerate(pools) for p in pool_placements(pool, i, head, layer))
            for pools in ranks]


def fill(ranks, whole: torch.Tensor) -> None:
    """Each pool gets its heads and layers of `whole` [pages, layers, 2, page, HEADS, DIM]."""
    for pools in ranks:
        for pool, head, layer in pools:
            pool.buffer.copy_(whole[:, layer:layer + pool.num_layers, :, :, head:head + pool.kv_heads])
            if pool.extra_layers:  # the draft's layers in the same pages
                end = layer + pool.num_layers + pool.extra_layers
                KVPool.layers_of(pool).buffer.copy_(whole[:, layer + pool.num_layers:end, :, :,
                                                          head:head + pool.kv_heads])


def apply(runs: dict, src: list[list[KVPool]], dst: list[list[KVPool]], src_pages, dst_pages) -> int:
    """What a transfer engine does with the runs (byte copies between registered pages); -> descriptors."""
    count = 0
    for (s_rank, d_rank), rank_runs in runs.items():
        for run in rank_runs:
            s_bytes = src[s_rank][run.src_pool][0].storage.view(torch.uint8).view(PAGES, -1)
            d_bytes = dst[d_rank][run.dst_pool][0].storage.view(torch.uint8).view(PAGES, -1)
            for sp, dp in zip(src_pages, dst_pages):
                d_bytes[dp, run.dst_offset:run.dst_offset + run.num_bytes] = \
                    s_bytes[sp, run.src_offset:run.src_offset + run.num_bytes]
                count += 1
    return count


PAIRS = [(1, 2), (2, 1), (2, 2), (1, 3), (3, 1), (2, 4), (4, 2), (3, 3)]


@pytest.mark.parametrize("mode", ["both", "decode-only"])
@pytest.mark.parametrize("p_tp,d_tp", PAIRS, ids=[f"{p}to{d}" for p, d in PAIRS])
def test_every_tp_pair_moves_whole_head_ranges_and_lands_what_tp1_holds(p_tp, d_tp, mode):
    gen = torch.Generator().manual_seed(p_tp * 10 + d_tp)
    whole = torch.randn(PAGES, TARGET_LAYERS + DRAFT_LAYERS, 2, PAGE, HEADS, DIM, generator=gen)
    # decode-only: P holds the target's layers only, D keeps its draft's KV in a pool of its own (not moved)
    src, dst = side(p_tp, mode), side(d_tp, mode)
    fill(src, whole)
    layers = range(TARGET_LAYERS + (DRAFT_LAYERS if mode == "both" else 0))
    runs = plan(placements(src), placements(dst), layers)
    src_pages, dst_pages = [4, 0, 2], [1, 5, 3]
    descriptors = apply(runs, src, dst, src_pages, dst_pages)
    expect = torch.zeros_like(whole)
    expect[dst_pages] = whole[src_pages]
    want = side(d_tp, mode)
    fill(want, expect)
    for got_pools, want_pools in zip(dst, want):
        for (got, _, _), (pool, _, _) in zip(got_pools, want_pools):
            assert torch.equal(got.storage, pool.storage)
    # one run per page and overlapping head range of the target's layers (P rank p's and D rank d's heads overlap
    # in one range), and one for the draft's (every head, rank 0 to rank 0), merged into one when whole pages move
    overlaps = sum(1 for p in range(p_tp) for d in range(d_tp)
                   if max(p * HEADS // p_tp, d * HEADS // d_tp) < min((p + 1) * HEADS // p_tp, (d + 1) * HEADS // d_tp))
    per_page = sum(len(r) for r in runs.values())
    assert per_page == overlaps + (1 if mode == "both" and max(p_tp, d_tp) > 1 else 0)
    assert descriptors == per_page * len(src_pages)


def test_a_pair_that_does_not_fit_is_refused_naming_both_sides():
    src, dst = side(2, "decode-only"), side(3, "both")  # D expects draft layers that P does not hold
    with pytest.raises(LayoutMismatch, match=r"which 0 prefill pools hold, not one: prefill TP 2: rank 0 "
                                             r"\[heads 0-5 x layers 0-2\].*decode TP 3"):
        plan(placements(src), placements(dst), range(TARGET_LAYERS + DRAFT_LAYERS))
    small = [[(KVPool(PAGES, TARGET_LAYERS, PAGE * 2, HEADS, DIM, torch.float32), 0, 0)]]  # another page size
    with pytest.raises(LayoutMismatch, match="block of"):
        plan(placements(small), placements(side(1, "decode-only")), range(TARGET_LAYERS))
