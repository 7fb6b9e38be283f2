"""Tree-masked verify attention: the reference against an independent per-node oracle, then the
Triton extend kernel (under TRITON_INTERPRET=1) and both backends against the reference.

Batches mix tree and causal sequences over a real multi-layer pool with scattered pages.
"""
from __future__ import annotations

import pytest
import torch

from specpd.attention.metadata import AttentionMetadata
from specpd.attention.reference import gather_kv, paged_attention_ref
from specpd.attention.torch_backend import TorchAttentionBackend
from specpd.attention.triton_backend import TritonAttentionBackend
from specpd.kernels.paged_attention import paged_extend_attention
from tests.kernels.test_paged_attention import LAYER, TOL, make_batch


def random_parents(num_nodes: int, gen: torch.Generator) -> list[int]:
    """A rooted tree numbered parents first: node 0 is the root (-1), node i > 0 hangs under a node < i."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_nodes)]


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool, [i, j] = node j is node i or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def shuffled(mask: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The same tree with its nodes stored in random order: ancestors may come after descendants."""
    perm = torch.randperm(mask.shape[0], generator=gen)
    return mask[perm][:, perm]


def tree_batch(q_lens, kv_lens, trees, hq, hkv, d, page_size, dtype, seed=0):
    """trees[b]: None (causal), "tree" (random ancestor mask) or "shuffled" (same, nodes out of order)."""
    pool, meta, q = make_batch(q_lens, kv_lens, hq, hkv, d, page_size, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    masks = []
    for q_len, kind in zip(q_lens, trees):
        mask = None if kind is None else ancestor_mask(random_parents(q_len, gen))
        masks.append(shuffled(mask, gen) if kind == "shuffled" else mask)
    page_lists = [meta.page_table[b, :(kv + page_size - 1) // page_size].tolist() for b, kv in enumerate(kv_lens)]
    return pool, AttentionMetadata.build(q_lens, kv_lens, page_lists, page_size, tree_masks=masks), q, masks


def reference(pool, meta, q, sm_scale):
    return paged_attention_ref(q, pool.k_cache(LAYER), pool.v_cache(LAYER), meta.qo_indptr, meta.kv_lens,
                               meta.page_table, sm_scale, meta.tree_mask, meta.tree_mask_indptr)


def test_metadata_layout():
    masks = [None, torch.ones(2, 2, dtype=torch.bool).tril(), None, ancestor_mask([-1, 0, 0])]
    meta = AttentionMetadata.build([1, 2, 4, 3], [5, 6, 4, 3], [[0, 1], [2, 3], [4], [5]], 4, tree_masks=masks)
    assert meta.tree_mask_indptr.tolist() == [0, 0, 4, 4, 13]
    assert meta.tree_mask.dtype == torch.bool
    assert meta.tree_mask[4:].view(3, 3).tolist() == [[True, False, False], [True, True, False], [True, False, True]]
    assert AttentionMetadata.build([2], [2], [[0]], 4, tree_masks=[None]).tree_mask is None


@pytest.mark.parametrize("bad,match", [
    (torch.ones(3, 3, dtype=torch.bool), r"\[2, width >= 2\] bool"),
    (torch.ones(2, 1, dtype=torch.bool), r"\[2, width >= 2\] bool"),
    (torch.ones(2, 2, dtype=torch.int32), r"\[2, width >= 2\] bool"),
    (torch.tensor([[True, False], [True, False]]), "diagonal"),
])
def test_metadata_rejects_bad_masks(bad, match):
    with pytest.raises(ValueError, match=match):
        AttentionMetadata.build([1, 2], [3, 4], [[0], [1]], 4, tree_masks=[None, bad])


def test_reference_matches_per_node_oracle():
    """Each node attends exactly to the prefix plus its own root path, as if that path were the sequence."""
    q_lens, kv_lens = [7, 12], [18, 12]
    pool, meta, q, masks = tree_batch(q_lens, kv_lens, ["tree", "shuffled"], 4, 2, 16, 4, torch.float32)
    k_cache, v_cache = pool.k_cache(LAYER), pool.v_cache(LAYER)
    out = reference(pool, meta, q, 0.25)
    row = 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        prefix = kv_len - q_len
        k = gather_kv(k_cache, meta.page_table[b], kv_len).repeat_interleave(2, dim=1)  # [kv_len, Hq, D]
        v = gather_kv(v_cache, meta.page_table[b], kv_len).repeat_interleave(2, dim=1)
        for i in range(q_len):
            seen = list(range(prefix)) + [prefix + j for j in range(q_len) if masks[b][i, j]]
            probs = (torch.einsum("hd,khd->hk", q[row], k[seen]) * 0.25).softmax(-1)
            torch.testing.assert_close(out[row], torch.einsum("hk,khd->hd", probs, v[seen]), **TOL[torch.float32])
            row += 1


@pytest.mark.triton_interpreter
def test_lower_triangular_tree_is_exactly_causal():
    q_lens, kv_lens = [1, 5, 9], [7, 13, 9]
    pool, meta, q = make_batch(q_lens, kv_lens, 2, 1, 16, 4, torch.float32)
    tril = [torch.ones(n, n, dtype=torch.bool).tril() for n in q_lens]
    page_lists = [meta.page_table[b].tolist() for b in range(3)]
    tree_meta = AttentionMetadata.build(q_lens, kv_lens, page_lists, 4, tree_masks=tril)
    k_cache, v_cache = pool.k_cache(LAYER), pool.v_cache(LAYER)
    assert torch.equal(reference(pool, tree_meta, q, 0.25), reference(pool, meta, q, 0.25))
    causal = paged_extend_attention(q, k_cache, v_cache, meta.qo_indptr, meta.kv_lens, meta.page_table, 0.25,
                                    block_m=16, block_n=16)
    tree = paged_extend_attention(q, k_cache, v_cache, meta.qo_indptr, meta.kv_lens, meta.page_table, 0.25,
                                  block_m=16, block_n=16, tree_mask=tree_meta.tree_mask,
                                  tree_mask_indptr=tree_meta.tree_mask_indptr)
    assert torch.equal(tree, causal)


# (q_lens, kv_lens, trees, Hq, Hkv, D, page_size, dtype, block_m, block_n)
TREE_CASES = {
    # decode row, tree after a prefix, causal extend, tree with no prefix (kv == q)
    "mixed_gqa4_p4_fp32": ([1, 6, 17, 9], [9, 14, 40, 9], [None, "tree", None, "tree"], 4, 1, 32, 4,
                           torch.float32, 16, 16),
    # prefixes ending exactly at a page boundary (16, 32) and one past it (17)
    "page_boundaries_gqa3_p16_fp32": ([7, 10, 5], [23, 42, 22], ["tree", "tree", "tree"], 6, 2, 64, 16,
                                      torch.float32, 16, 16),
    # nodes out of order across query blocks; a no-prefix tree whose rows see nothing in early blocks
    "shuffled_multiblock_p1_fp32": ([40, 20], [40, 45], ["shuffled", "shuffled"], 2, 2, 16, 1,
                                    torch.float32, 16, 16),
    "mixed_gqa3_p16_fp16": ([1, 11, 25], [30, 27, 64], [None, "tree", "tree"], 6, 2, 64, 16,
                            torch.float16, 16, 32),
    "mixed_gqa4_p4_bf16": ([8, 3, 20], [8, 12, 36], ["tree", None, "shuffled"], 4, 1, 128, 4,
                           torch.bfloat16, 16, 16),
}


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("case", list(TREE_CASES), ids=list(TREE_CASES))
def test_tree_extend_matches_reference(case):
    q_lens, kv_lens, trees, hq, hkv, d, page_size, dtype, block_m, block_n = TREE_CASES[case]
    pool, meta, q, _ = tree_batch(q_lens, kv_lens, trees, hq, hkv, d, page_size, dtype)
    sm_scale = d ** -0.5
    out = paged_extend_attention(q, pool.k_cache(LAYER), pool.v_cache(LAYER), meta.qo_indptr, meta.kv_lens,
                                 meta.page_table, sm_scale, block_m=block_m, block_n=block_n,
                                 tree_mask=meta.tree_mask, tree_mask_indptr=meta.tree_mask_indptr)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), reference(pool, meta, q, sm_scale).float(), **TOL[dtype])


def test_tree_mask_changes_the_output():
    """The inputs separate a tree from causal attention: a kernel ignoring the mask would fail."""
    pool, meta, q, _ = tree_batch([12], [20], ["tree"], 2, 1, 16, 4, torch.float32)
    causal = paged_attention_ref(q, pool.k_cache(LAYER), pool.v_cache(LAYER), meta.qo_indptr, meta.kv_lens,
                                 meta.page_table, 0.25)
    tree = reference(pool, meta, q, 0.25)
    differs = (tree - causal).abs().amax(dim=(1, 2)) > 1e-3
    assert differs.sum() >= 6  # every node with a non-parent earlier sibling or cousin
    assert not differs[:2].any()  # root and its first child see the same in both


@pytest.mark.parametrize("backend_cls", [pytest.param(TorchAttentionBackend, id="torch"), pytest.param(
    TritonAttentionBackend, id="triton", marks=pytest.mark.triton_interpreter)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_tree_verify(backend_cls, dtype):
    """Writes the tree's K/V into its scratch slots, then attends with the mask."""
    hq, hkv, d, page_size = 4, 2, 16, 4
    q_lens, kv_lens = [1, 7, 5], [6, 15, 5]
    pool, meta, q, _ = tree_batch(q_lens, kv_lens, [None, "tree", "shuffled"], hq, hkv, d, page_size, dtype, seed=3)
    k_new = torch.randn(q.shape[0], hkv, d).to(dtype)
    v_new = torch.randn(q.shape[0], hkv, d).to(dtype)
    backend = backend_cls(pool, hq, d)
    out = backend.forward(q, k_new, v_new, LAYER, backend.plan(meta))
    assert torch.equal(pool.k_cache(LAYER)[meta.write_pages, meta.write_offsets], k_new)
    torch.testing.assert_close(out.float(), reference(pool, meta, q, d ** -0.5).float(), **TOL[dtype])


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_wide_tree_mask_matches_reference(dtype):
    """Draft-step masks: a [q_len, width > q_len] block over the last `width` KV positions."""
    from specpd.attention.metadata import AttentionMetadata
    from specpd.attention.reference import paged_attention_ref
    from specpd.kernels.paged_attention import paged_extend_attention
    from specpd.kv.pool import KVPool
    torch.manual_seed(0)
    pool = KVPool(48, 2, 4, 2, 16, dtype)
    pool.buffer.normal_()
    pages = torch.randperm(48).tolist()
    q_lens, kv_lens = [3, 2, 4], [13, 9, 7]
    widths = [9, 2, 4]  # wide, square, square-with-no-prefix... first has 4 visible prefix slots
    masks = []
    for q, w in zip(q_lens, widths):
        m = torch.rand(q, w) < 0.5
        m[torch.arange(q), w - q + torch.arange(q)] = True
        masks.append(m)
    masks[1] = None  # a causal sequence in the same batch
    meta = AttentionMetadata.build(q_lens, kv_lens, [pages[0:4], pages[4:7], pages[7:9]], 4, tree_masks=masks)
    q = torch.randn(sum(q_lens), 4, 16, dtype=dtype)
    args = (q, pool.k_cache(1), pool.v_cache(1), meta.qo_indptr, meta.kv_lens, meta.page_table, 0.25)
    ref = paged_attention_ref(*args, tree_mask=meta.tree_mask, tree_mask_indptr=meta.tree_mask_indptr)
    out = paged_extend_attention(*args, tree_mask=meta.tree_mask, tree_mask_indptr=meta.tree_mask_indptr)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    # the wide block really restricts: all-visible attention differs
    full = paged_attention_ref(*args)
    assert (full[:3] - ref[:3]).abs().max() > 1e-3
    # the torch backend agrees (re-writing the slots' current K/V leaves the cache unchanged)
    be = TorchAttentionBackend(pool, 4, 16, sm_scale=0.25)
    be.plan(meta)
    k_new = pool.buffer[meta.write_pages, 1, 0, meta.write_offsets]
    v_new = pool.buffer[meta.write_pages, 1, 1, meta.write_offsets]
    torch.testing.assert_close(be.forward(q, k_new, v_new, 1, meta), ref, atol=tol, rtol=tol)
