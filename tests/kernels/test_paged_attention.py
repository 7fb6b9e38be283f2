"""Triton paged attention (under TRITON_INTERPRET=1) against the torch reference.

Every case uses a real multi-layer KVPool, so the per-layer caches are strided views, with page
tables drawn from a shuffled page list (pages of one sequence are scattered and out of order).
"""
from __future__ import annotations

import pytest
import torch

from specpd.attention.metadata import AttentionMetadata
from specpd.attention.reference import paged_attention_ref
from specpd.attention.triton_backend import TritonAttentionBackend
from specpd.kernels.paged_attention import paged_decode_attention, paged_extend_attention
from specpd.kv.pool import KVPool

LAYER = 1  # a middle layer of 3: its view starts mid-page and skips the other layers
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5),
       torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_batch(q_lens, kv_lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype, seed=0):
    """Random pool + scattered page tables + queries. Returns (pool, meta, q)."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [(kv + page_size - 1) // page_size for kv in kv_lens]
    num_pages = sum(pages_per_seq) + 3  # spare pages stay untouched and must not be read
    pool = KVPool(num_pages, 3, page_size, num_kv_heads, head_dim, dtype)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen))
    perm = torch.randperm(num_pages, generator=gen).tolist()
    page_lists, used = [], 0
    for n in pages_per_seq:
        page_lists.append(perm[used:used + n])
        used += n
    meta = AttentionMetadata.build(q_lens, kv_lens, page_lists, page_size)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    assert not pool.k_cache(LAYER).is_contiguous()
    return pool, meta, q


def reference(pool, meta, q, sm_scale):
    return paged_attention_ref(q, pool.k_cache(LAYER), pool.v_cache(LAYER), meta.qo_indptr, meta.kv_lens,
                               meta.page_table, sm_scale)


# (q_lens, kv_lens, Hq, Hkv, D, page_size, dtype, block_m, block_n)
EXTEND_CASES = {
    # mixed decode rows, fresh prefill (kv == q) and extend after a cached prefix
    "ragged_gqa4_p4_fp32": ([1, 3, 17, 33], [9, 3, 40, 33], 4, 1, 32, 4, torch.float32, 16, 16),
    "page1_mha_fp32": ([2, 5, 1], [19, 5, 7], 2, 2, 16, 1, torch.float32, 16, 16),
    # lengths exactly at and one past page boundaries, default blocks
    "boundaries_gqa3_p16_fp32": ([16, 1, 7, 33], [16, 17, 32, 33], 6, 2, 64, 16, torch.float32, 64, 64),
    "page64_two_pages_fp32": ([1, 70], [64, 130], 2, 1, 32, 64, torch.float32, 32, 32),
    "head_dim8_fp32": ([4, 9], [4, 20], 2, 1, 8, 4, torch.float32, 16, 16),
    "head_dim24_unpadded_fp32": ([3, 6], [11, 6], 2, 2, 24, 4, torch.float32, 16, 16),
    "ragged_gqa3_p16_fp16": ([1, 17, 33], [30, 17, 65], 6, 2, 64, 16, torch.float16, 16, 32),
    "ragged_gqa4_p4_bf16": ([3, 1, 20], [8, 4, 36], 4, 1, 128, 4, torch.bfloat16, 16, 16),
}


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("case", list(EXTEND_CASES), ids=list(EXTEND_CASES))
def test_extend_matches_reference(case):
    q_lens, kv_lens, hq, hkv, d, page_size, dtype, block_m, block_n = EXTEND_CASES[case]
    pool, meta, q = make_batch(q_lens, kv_lens, hq, hkv, d, page_size, dtype)
    sm_scale = d ** -0.5
    out = paged_extend_attention(q, pool.k_cache(LAYER), pool.v_cache(LAYER), meta.qo_indptr, meta.kv_lens,
                                 meta.page_table, sm_scale, block_m=block_m, block_n=block_n)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), reference(pool, meta, q, sm_scale).float(), **TOL[dtype])


@pytest.mark.triton_interpreter
def test_extend_strided_q_and_out_buffer():
    """q as a slice of a fused qkv tensor; output written into a caller buffer."""
    pool, meta, q = make_batch([5, 12], [13, 12], 4, 2, 16, 4, torch.float32)
    qkv = torch.cat([q, torch.randn(q.shape[0], 4, 16)], dim=1)  # [T, Hq + 2 * Hkv, D]
    q_view = qkv[:, :4]
    assert not q_view.is_contiguous()
    out = torch.full_like(q, float("nan"))
    ret = paged_extend_attention(q_view, pool.k_cache(LAYER), pool.v_cache(LAYER), meta.qo_indptr,
                                 meta.kv_lens, meta.page_table, 0.25, out=out, block_m=16, block_n=16)
    assert ret is out
    torch.testing.assert_close(out, reference(pool, meta, q, 0.25), **TOL[torch.float32])


# (kv_lens, Hq, Hkv, D, page_size, dtype, num_splits, block_n); num_splits None = heuristic
DECODE_CASES = {
    "boundaries_gqa4_p4_fp32_split3": ([1, 4, 5, 16, 17, 63, 64, 65], 4, 1, 32, 4, torch.float32, 3, 16),
    "mha_p1_fp32_nosplit": ([1, 2, 9, 31], 3, 3, 16, 1, torch.float32, 1, 16),
    "gqa3_p16_fp32_auto": ([15, 16, 17, 48, 100], 6, 2, 64, 16, torch.float32, None, 16),
    "page64_fp32_split2": ([64, 65, 129], 2, 2, 32, 64, torch.float32, 2, 32),
    "more_splits_than_kv_fp32": ([3, 40], 2, 1, 16, 4, torch.float32, 8, 16),
    "gqa3_p16_fp16_split2": ([16, 33, 70], 6, 2, 64, 16, torch.float16, 2, 32),
    "gqa4_p4_bf16_split4": ([5, 29, 64], 4, 1, 128, 4, torch.bfloat16, 4, 16),
}


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("case", list(DECODE_CASES), ids=list(DECODE_CASES))
def test_decode_matches_reference(case):
    kv_lens, hq, hkv, d, page_size, dtype, num_splits, block_n = DECODE_CASES[case]
    pool, meta, q = make_batch([1] * len(kv_lens), kv_lens, hq, hkv, d, page_size, dtype)
    sm_scale = d ** -0.5
    out = paged_decode_attention(q, pool.k_cache(LAYER), pool.v_cache(LAYER), meta.kv_lens, meta.page_table,
                                 sm_scale, num_splits=num_splits, block_n=block_n)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), reference(pool, meta, q, sm_scale).float(), **TOL[dtype])


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("q_lens,kv_lens", [([1, 1, 1], [4, 17, 33]), ([1, 6, 1, 16], [5, 21, 16, 16])],
                         ids=["decode", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_writes_kv_then_attends(q_lens, kv_lens, dtype):
    hq, hkv, d, page_size = 4, 2, 16, 4
    pool, meta, q = make_batch(q_lens, kv_lens, hq, hkv, d, page_size, dtype, seed=1)
    num_tokens = q.shape[0]
    k_new = torch.randn(num_tokens, hkv, d).to(dtype)
    v_new = torch.randn(num_tokens, hkv, d).to(dtype)
    other_layers = pool.buffer[:, [0, 2]].clone()

    backend = TritonAttentionBackend(pool, hq, d)
    out = backend.forward(q, k_new, v_new, LAYER, backend.plan(meta))

    assert torch.equal(pool.k_cache(LAYER)[meta.write_pages, meta.write_offsets], k_new)
    assert torch.equal(pool.v_cache(LAYER)[meta.write_pages, meta.write_offsets], v_new)
    assert torch.equal(pool.buffer[:, [0, 2]], other_layers)
    torch.testing.assert_close(out.float(), reference(pool, meta, q, d ** -0.5).float(), **TOL[dtype])


@pytest.mark.triton_interpreter
def test_a_wrong_mask_would_be_caught():
    """The inputs must separate causal-with-offset from full attention and from an off-by-one length."""
    pool, meta, q = make_batch([1, 8, 17], [6, 8, 29], 2, 1, 16, 4, torch.float32)
    k_cache, v_cache = pool.k_cache(LAYER), pool.v_cache(LAYER)
    ref = reference(pool, meta, q, 0.25)
    out = paged_extend_attention(q, k_cache, v_cache, meta.qo_indptr, meta.kv_lens, meta.page_table, 0.25,
                                 block_m=16, block_n=16)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])

    # full (non-causal) attention: every query sees the whole kv_len
    full = torch.empty_like(q)
    for b, (start, end) in enumerate(zip(meta.qo_indptr[:-1].tolist(), meta.qo_indptr[1:].tolist())):
        kv_len = meta.kv_lens_host[b]
        for row in range(start, end):
            one = AttentionMetadata.build([1], [kv_len], [meta.page_table[b].tolist()], meta.page_size)
            full[row] = paged_attention_ref(q[row:row + 1], k_cache, v_cache, one.qo_indptr, one.kv_lens,
                                            one.page_table, 0.25)[0]
    rows_with_future = [r for b in (1, 2) for r in range(meta.qo_indptr[b], meta.qo_indptr[b + 1] - 1)]
    assert (out[rows_with_future] - full[rows_with_future]).abs().amax(dim=(1, 2)).min() > 1e-3

    # decode over one position too few
    dq = q[:3]
    dmeta = AttentionMetadata.build([1, 1, 1], [6, 8, 29], [r.tolist() for r in meta.page_table], 4)
    short = dmeta.kv_lens - 1
    decode = paged_decode_attention(dq, k_cache, v_cache, dmeta.kv_lens, dmeta.page_table, 0.25, block_n=16)
    shorter = paged_attention_ref(dq, k_cache, v_cache, dmeta.qo_indptr, short, dmeta.page_table, 0.25)
    torch.testing.assert_close(decode, paged_attention_ref(dq, k_cache, v_cache, dmeta.qo_indptr, dmeta.kv_lens,
                                                           dmeta.page_table, 0.25), **TOL[torch.float32])
    assert (decode - shorter).abs().amax(dim=(1, 2)).min() > 1e-3


@pytest.mark.parametrize("q_lens,kv_lens,groups", [([1, 1, 1, 1, 1, 1], [5, 7, 900, 6, 1000, 30], 2),
                                                   ([1, 3, 1, 2, 40], [520, 3, 9, 700, 80], 4)],
                         ids=["decode", "mixed"])
def test_torch_backend_groups_rows_by_kv_length(q_lens, kv_lens, groups):
    """Short rows are attended in batches grouped by KV length (one long context must not pad them all),
    one-row queries apart from multi-row blocks (mixed: short / long contexts of each); scattered pages,
    the output equals the reference in every group, in batch order."""
    from specpd.attention.torch_backend import TorchAttentionBackend, group_by_pages
    hq, hkv, d, page_size = 4, 2, 16, 4
    pool, meta, q = make_batch(q_lens, kv_lens, hq, hkv, d, page_size, torch.float32, seed=2)
    k_new, v_new = torch.randn(q.shape[0], hkv, d), torch.randn(q.shape[0], hkv, d)
    backend = TorchAttentionBackend(pool, hq, d)
    plan = backend.plan(meta)
    assert len(plan.plan.padded) == groups
    out = backend.forward(q, k_new, v_new, LAYER, plan)
    torch.testing.assert_close(out, reference(pool, meta, q, d ** -0.5), **TOL[torch.float32])
    assert group_by_pages([3, 3, 3]) == [[0, 1, 2]] and group_by_pages([1, 500, 2]) == [[0, 2], [1]]


def _grouping_cost(pages: list[int], groups: list[list[int]], call_cost: int) -> int:
    return sum(len(g) * max(pages[i] for i in g) + call_cost for g in groups)


def _best_cost_over_every_sequence(pages: list[int], call_cost: int) -> int:
    """The reference: the DP over single sequences (every cut of the sorted order allowed)."""
    top = sorted(pages)
    best = [0] + [None] * len(top)
    for j in range(1, len(top) + 1):
        best[j] = min(best[i] + (j - i) * top[j - 1] + call_cost for i in range(j))
    return best[-1]


@pytest.mark.parametrize("seed", range(6))
def test_grouping_by_length_runs_is_as_good_as_by_sequence(seed):
    """group_by_pages cuts only between distinct lengths: on ragged batches full of ties its grouping
    costs exactly what the optimum over every cut costs, and covers every sequence once."""
    from specpd.attention.torch_backend import group_by_pages
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 60, (1,), generator=gen))
    spread = [3, 40, 400][seed % 3]
    pages = torch.randint(1, spread + 1, (n,), generator=gen).tolist()
    for call_cost in (1, 64, 500):
        groups = group_by_pages(pages, call_cost)
        assert sorted(i for g in groups for i in g) == list(range(n))
        assert _grouping_cost(pages, groups, call_cost) == _best_cost_over_every_sequence(pages, call_cost)
    assert group_by_pages([7] * 1024) == [list(range(1024))]
