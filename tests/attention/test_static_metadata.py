"""Padded batches in static buffers (specpd/attention/static.py) and the backends' plans into them.

The padded path is what a CUDA graph replays; here it runs eagerly on CPU (Triton under TRITON_INTERPRET=1):
bucket selection, the layout (pad rows write the scratch slot only, real rows keep their positions and masks),
buffers reused across steps and buckets, plan_static making no new tensors, and each real row's attention output
equal to the plain (unpadded) path's on ragged, scattered, page-boundary batches with tree masks.
"""
from __future__ import annotations

import pytest
import torch

from specpd.attention.metadata import AttentionMetadata
from specpd.attention.reference import paged_attention_ref
from specpd.attention.static import StaticMetadata, pad_layout, write_slots
from specpd.attention.torch_backend import TorchAttentionBackend
from specpd.attention.triton_backend import TritonAttentionBackend
from specpd.kv.pool import KVPool
from specpd.model.cuda_graphs import bucket_for, buckets
from tests.kernels.test_tree_attention import ancestor_mask, random_parents, shuffled

LAYER = 1
NUM_PAGES, MAX_PAGES = 40, 12
BACKENDS = [pytest.param(TorchAttentionBackend, id="torch"),  # Triton on CPU tensors: interpreted
            pytest.param(TritonAttentionBackend, id="triton", marks=pytest.mark.triton_interpreter)]
TOL = {torch.float32: dict(atol=3e-5, rtol=3e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def test_buckets_and_selection():
    assert buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert buckets(1) == [1] and buckets(6) == [1, 2, 4, 6] and buckets(12) == [1, 2, 4, 8, 12]
    sizes = buckets(32)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 31, 32, 33)] == [1, 2, 4, 8, 8, 16, 32, 32, None]


def _batch(q_lens, kv_lens, trees, page_size, seed=0, wide=0):
    """Scattered page lists drawn from a shuffled pool (page 0 reserved as the scratch page), tree masks:
    None (causal), "tree", "shuffled" (nodes out of order) or, with `wide`, draft-step blocks [q, wide + q]."""
    gen = torch.Generator().manual_seed(seed)
    free = (torch.randperm(NUM_PAGES - 1, generator=gen) + 1).tolist()
    page_lists = [[free.pop() for _ in range(-(-kv // page_size) + 1)] for kv in kv_lens]  # one spare page each
    masks = []
    for q, kind in zip(q_lens, trees):
        if kind is None:
            masks.append(None)
        elif wide:
            m = torch.rand(q, wide + q, generator=gen) < 0.5
            m[torch.arange(q), wide + torch.arange(q)] = True
            masks.append(m)
        else:
            m = ancestor_mask(random_parents(q, gen))
            masks.append(shuffled(m, gen) if kind == "shuffled" else m)
    return page_lists, masks if any(m is not None for m in masks) else None


def test_layout_pads_rows_and_requests():
    q_lens, kv_lens = [3, 1, 4], [9, 16, 5]
    page_lists, masks = _batch(q_lens, kv_lens, ["tree", None, "shuffled"], 4)
    lay = pad_layout(q_lens, kv_lens, page_lists, masks, bucket=4, width=5, page_size=4, max_pages=MAX_PAGES,
                     scratch_page=0)
    assert lay.mask_width == 5 and lay.tree_mask.shape == (4, 5, 5)
    assert lay.real_rows == [0, 1, 2, 5, 10, 11, 12, 13]
    assert lay.kv_lens == [11, 20, 6, 5]  # real rows keep their positions; the pad request sees its own rows
    assert lay.last_rows == [2, 5, 13, 19] and lay.last_kv_lens == [9, 16, 5, 1]
    # real rows write their own slots, every pad row the scratch slot
    slots = write_slots(lay, 4)
    real = {r for r in lay.real_rows}
    expect = [p[pos // 4] * 4 + pos % 4 for q, kv, p in zip(q_lens, kv_lens, page_lists) for pos in range(kv - q, kv)]
    assert [slots[r] for r in lay.real_rows] == expect
    assert all(slots[r] == 0 for r in range(20) if r not in real)
    # a real row sees what its own mask lets it see and no pad position; a pad row sees itself
    block = lay.tree_mask[0]  # request 0: 3 tree rows, 2 pad rows, block over positions 6..10
    assert torch.equal(block[:3, :3], masks[0]) and not block[:3, 3:].any()
    assert block[3:].tolist() == [[False, False, False, True, False], [False] * 4 + [True]]
    causal = lay.tree_mask[1]  # request 1 (causal, one row): only its own position in the block
    assert causal[0].tolist() == [True, False, False, False, False]
    assert lay.tree_mask[3].tolist() == torch.eye(5, dtype=torch.bool).tolist()


def test_layout_refuses_what_does_not_fit():
    page_lists, _ = _batch([2, 1], [6, 9], [None, None], 4)
    assert pad_layout([2, 1], [6, 9], page_lists, None, 1, 4, 4, MAX_PAGES, 0) is None  # two requests, bucket 1
    assert pad_layout([2, 1], [6, 9], page_lists, None, 2, 1, 4, MAX_PAGES, 0) is None  # two rows, width 1
    assert pad_layout([2, 1], [6, 9], page_lists, None, 2, 2, 4, 2, 0) is None  # 9 positions on 2 pages of 4


def _pool(dtype, page_size, seed=0):
    pool = KVPool(NUM_PAGES, 3, page_size, 2, 16, dtype)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def test_static_buffers_are_reused_across_steps_and_buckets():
    static = StaticMetadata(8, 5, MAX_PAGES, 25, 4, torch.device("cpu"))
    ptrs = None
    for step, (q_lens, kv_lens, bucket) in enumerate([([3, 1, 4], [9, 16, 5], 4), ([2, 5], [30, 7], 2),
                                                       ([1] * 7, list(range(3, 10)), 8)]):
        page_lists, masks = _batch(q_lens, kv_lens, ["tree"] * len(q_lens), 4, seed=step)
        meta = static.load(pad_layout(q_lens, kv_lens, page_lists, masks, bucket, 5, 4, MAX_PAGES, 0))
        now = [t.data_ptr() for t in (meta.qo_indptr, meta.kv_lens, meta.page_table, meta.write_pages,
                                      meta.write_offsets, meta.tree_mask, meta.tree_mask_indptr)]
        assert ptrs is None or now == ptrs  # every bucket's tensors are prefix views of the same storage
        ptrs = now
        assert meta.qo_indptr.tolist() == list(range(0, 5 * bucket + 1, 5))
        assert meta.kv_lens.tolist() == [kv + 5 - q for q, kv in zip(q_lens, kv_lens)] + [5] * (bucket - len(q_lens))


def _attend(backend, meta, q, k, v):
    return backend.forward(q, k, v, LAYER, meta)


CASES = {  # q_lens, kv_lens, trees, page_size, bucket, width, wide (draft-step blocks)
    "decode_ragged_page_boundaries": ([1, 1, 1], [4, 17, 33], [None] * 3, 4, 4, 1, 0),
    "verify_trees_and_a_chain": ([5, 1, 3, 4], [9, 16, 3, 36], ["tree", None, "shuffled", None], 4, 8, 5, 0),
    "verify_page16_boundaries": ([6, 2], [16, 33], ["shuffled", "tree"], 16, 2, 8, 0),
    "draft_step_blocks": ([3, 2, 3], [13, 9, 21], ["w", "w", "w"], 4, 4, 3, 6),
    "extend_causal_page1": ([2, 4, 1], [7, 4, 12], [None] * 3, 1, 4, 4, 0),
}


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_padded_static_attention_equals_plain(case, dtype, backend_cls):
    q_lens, kv_lens, trees, page_size, bucket, width, wide = CASES[case]
    max_pages = -(-(max(kv_lens) + width) // page_size) + 1
    page_lists, masks = _batch(q_lens, kv_lens, trees, page_size, wide=wide)
    gen = torch.Generator().manual_seed(5)
    n = sum(q_lens)
    q = torch.randn(n, 4, 16, generator=gen).to(dtype)
    k, v = (torch.randn(n, 2, 16, generator=gen).to(dtype) for _ in range(2))
    plain_pool, padded_pool = _pool(dtype, page_size), _pool(dtype, page_size)
    before = plain_pool.buffer.clone()

    meta = AttentionMetadata.build(q_lens, kv_lens, page_lists, page_size, tree_masks=masks)
    plain_backend = backend_cls(plain_pool, 4, 16)
    plain = plain_backend.forward(q, k, v, LAYER, plain_backend.plan(meta))
    ref = paged_attention_ref(q.float(), plain_pool.k_cache(LAYER).float(), plain_pool.v_cache(LAYER).float(),
                              meta.qo_indptr, meta.kv_lens, meta.page_table, 16 ** -0.5, meta.tree_mask,
                              meta.tree_mask_indptr)
    torch.testing.assert_close(plain.float(), ref, **TOL[dtype])

    lay = pad_layout(q_lens, kv_lens, page_lists, masks, bucket, width, page_size, max_pages, scratch_page=0)
    static = StaticMetadata(bucket, width, max_pages, width * max(lay.mask_width, 1), page_size,
                            torch.device("cpu"))
    backend = backend_cls(padded_pool, 4, 16)
    smeta = backend.plan_static(static.load(lay), max_pages * page_size)
    rows = torch.tensor(lay.real_rows)
    fill = torch.Generator().manual_seed(6)  # pad rows: any finite values
    q_pad = torch.randn(bucket * width, 4, 16, generator=fill).to(dtype)
    k_pad, v_pad = (torch.randn(bucket * width, 2, 16, generator=fill).to(dtype) for _ in range(2))
    q_pad[rows], k_pad[rows], v_pad[rows] = q, k, v
    out = backend.forward(q_pad, k_pad, v_pad, LAYER, smeta)
    torch.testing.assert_close(out[rows].float(), plain.float(), **TOL[dtype])
    assert not out.isnan().any()
    # padding never touched a live page: outside the scratch page both pools hold the same bytes, and only the
    # batch's own slots changed
    assert torch.equal(padded_pool.buffer[1:], plain_pool.buffer[1:])
    changed = (plain_pool.buffer != before).flatten(1).any(dim=1).nonzero().flatten().tolist()
    assert set(changed) <= {p for lst in page_lists for p in lst}


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_plan_static_writes_into_fixed_buffers(backend_cls):
    """Two steps of one shape: every tensor the forward reads (metadata and plan) is the same storage, and the
    plan's host values depend on the shape only."""
    pool = _pool(torch.float32, 4)
    backend = backend_cls(pool, 4, 16)
    static = StaticMetadata(4, 5, MAX_PAGES, 25, 4, torch.device("cpu"))
    seen = []
    for seed, (q_lens, kv_lens) in enumerate([([3, 5], [9, 22]), ([5, 2, 1], [30, 6, 17])]):
        page_lists, masks = _batch(q_lens, kv_lens, ["tree"] * len(q_lens), 4, seed=seed)
        meta = backend.plan_static(static.load(pad_layout(q_lens, kv_lens, page_lists, masks, 4, 5, 4, MAX_PAGES,
                                                          0)), MAX_PAGES * 4)
        seen.append(meta)
    tensors = [_tensors(m) for m in seen]
    assert [t.data_ptr() for t in tensors[0]] == [t.data_ptr() for t in tensors[1]]
    hosts = [{k: v for k, v in vars(m.plan).items() if not isinstance(v, (torch.Tensor, list))} for m in seen]
    assert hosts[0] == hosts[1]


def _tensors(meta):
    out = [t for t in vars(meta).values() if isinstance(t, torch.Tensor)]
    plan = meta.plan
    for part in getattr(plan, "padded", []):
        out += [t for t in vars(part).values() if isinstance(t, torch.Tensor)]
    return out


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_one_row_tree_steps_keep_their_mask(backend_cls):
    """A tree draft step whose frontiers are one node each: every query is one row, but its block still hides the
    siblings' scratch slots (the Triton backend once took such a batch for plain decode)."""
    q_lens, kv_lens = [1, 1, 1], [11, 7, 17]
    masks = [torch.tensor([[True, False, False, True]]), torch.tensor([[False, True, True]]),
             torch.tensor([[False, False, True, False, True]])]
    page_lists, _ = _batch(q_lens, kv_lens, [None] * 3, 4)
    meta = AttentionMetadata.build(q_lens, kv_lens, page_lists, 4, tree_masks=masks)
    pool = _pool(torch.float32, 4)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 16, generator=gen)
    k, v = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    backend = backend_cls(pool, 4, 16)
    out = backend.forward(q, k, v, LAYER, backend.plan(meta))
    ref = paged_attention_ref(q, pool.k_cache(LAYER), pool.v_cache(LAYER), meta.qo_indptr, meta.kv_lens,
                              meta.page_table, 16 ** -0.5, meta.tree_mask, meta.tree_mask_indptr)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    causal = paged_attention_ref(q, pool.k_cache(LAYER), pool.v_cache(LAYER), meta.qo_indptr, meta.kv_lens,
                                 meta.page_table, 16 ** -0.5)
    assert (causal - ref).abs().amax() > 1e-3  # the masks matter here
