"""KV compaction: the reference's gather-then-scatter semantics by hand, the Triton kernel (under
TRITON_INTERPRET=1) bit-exact against it, and tree verify -> compact -> causal attention agreeing.
"""
from __future__ import annotations

import pytest
import torch

from specpd.attention.metadata import AttentionMetadata
from specpd.attention.reference import paged_attention_ref
from specpd.kernels.kv_compact import compact_kv, compact_kv_ref, path_slot_moves
from specpd.kv.pool import KVPool
from tests.kernels.test_tree_attention import ancestor_mask


def random_pool(num_pages, num_layers, page_size, kv_heads, head_dim, dtype, seed=0) -> KVPool:
    pool = KVPool(num_pages, num_layers, page_size, kv_heads, head_dim, dtype)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def slot(buffer, page, offset):
    return buffer[page, :, :, offset]  # [num_layers, 2, Hkv, D]


def as_tensors(*columns):
    return [torch.tensor(c, dtype=torch.int64) for c in columns]


COMPACTS = [pytest.param(compact_kv_ref, id="ref"),
            pytest.param(compact_kv, id="triton", marks=pytest.mark.triton_interpreter)]  # CPU: interpreted


def test_path_slot_moves_skips_nodes_in_place():
    # committed_len 6, page_size 4, pages [7, 2, 5, 1]: node i at position 6 + i
    moves = path_slot_moves([7, 2, 5, 1], 6, [0, 1, 3, 6], 4)
    # node 3 (pos 9) -> pos 8, node 6 (pos 12) -> pos 9
    assert moves == ([5, 1], [1, 0], [5, 5], [0, 1])


@pytest.mark.parametrize("compact", COMPACTS)
def test_overlapping_shift_across_pages(compact):
    """Accepted path [0, 2, 3, 5, 8] after committed_len 6: sources and destinations overlap."""
    pool = random_pool(5, 2, 4, 2, 8, torch.float32)
    pages, committed_len, path = [3, 0, 4, 1], 6, [0, 2, 3, 5, 8]
    before = pool.buffer.clone()
    compact(pool.buffer, *as_tensors(*path_slot_moves(pages, committed_len, path, 4)))
    for k, node in enumerate(path):
        dst, src = committed_len + k, committed_len + node
        assert torch.equal(slot(pool.buffer, pages[dst // 4], dst % 4), slot(before, pages[src // 4], src % 4))
    untouched = torch.ones(5, 4, dtype=torch.bool)
    for pos in range(committed_len + 1, committed_len + len(path)):
        untouched[pages[pos // 4], pos % 4] = False
    assert torch.equal(pool.buffer.permute(0, 3, 1, 2, 4, 5)[untouched], before.permute(0, 3, 1, 2, 4, 5)[untouched])


@pytest.mark.parametrize("compact", COMPACTS)
def test_permutation_is_gather_then_scatter(compact):
    """A 3-cycle and a swap: any in-place order would read a slot that was already overwritten."""
    pool = random_pool(3, 3, 2, 1, 4, torch.float16)
    before = pool.buffer.clone()
    src = [(0, 0), (1, 1), (2, 0), (0, 1), (2, 1)]
    dst = [(1, 1), (2, 0), (0, 0), (2, 1), (0, 1)]
    compact(pool.buffer, *as_tensors([p for p, _ in src], [o for _, o in src],
                                     [p for p, _ in dst], [o for _, o in dst]))
    for (sp, so), (dp, do) in zip(src, dst):
        assert torch.equal(slot(pool.buffer, dp, do), slot(before, sp, so))
    assert torch.equal(slot(pool.buffer, 1, 0), slot(before, 1, 0))


def test_ref_rejects_duplicate_destinations():
    pool = random_pool(2, 1, 2, 1, 4, torch.float32)
    with pytest.raises(ValueError, match="distinct"):
        compact_kv_ref(pool.buffer, *as_tensors([0, 1], [0, 0], [1, 1], [1, 1]))


# (num_layers, page_size, Hkv, D, dtype)
KERNEL_CASES = {
    "bf16_p4_gqa_heads2_d64": (3, 4, 2, 64, torch.bfloat16),
    "fp16_p1_d128": (2, 1, 1, 128, torch.float16),
    "fp32_p16_heads3_d24": (2, 16, 3, 24, torch.float32),  # slot of 72 elements: not a power of two
    "bf16_p8_slot_over_block": (1, 8, 8, 512, torch.bfloat16),  # 4096 elements: two BLOCK chunks
}


def accepted_paths_batch(case: str) -> tuple[KVPool, list[torch.Tensor]]:
    """KERNEL_CASES[case]: several sequences' accepted paths through random trees on scattered pages, as one
    call's moves (src_pages, src_offsets, dst_pages, dst_offsets), over a random pool."""
    num_layers, page_size, kv_heads, head_dim, dtype = KERNEL_CASES[case]
    gen = torch.Generator().manual_seed(1)
    committed_lens, tree_sizes = [page_size * 2, page_size * 2 - 1, 3, 0], [9, 12, 6, 7]
    pages_per_seq = [(c + t + page_size - 1) // page_size for c, t in zip(committed_lens, tree_sizes)]
    num_pages = sum(pages_per_seq) + 2
    perm = torch.randperm(num_pages, generator=gen).tolist()
    moves: list[list[int]] = [[], [], [], []]
    for seq, (committed_len, tree_size) in enumerate(zip(committed_lens, tree_sizes)):
        pages = perm[sum(pages_per_seq[:seq]):sum(pages_per_seq[:seq + 1])]
        leaf = int(torch.randint(1, tree_size, (1,), generator=gen))
        path = sorted(int(n) for n in torch.randperm(leaf, generator=gen)[:leaf // 2]) + [leaf]
        for column, values in zip(moves, path_slot_moves(pages, committed_len, path, page_size)):
            column.extend(values)
    assert len(moves[0]) >= 4
    return random_pool(num_pages, num_layers, page_size, kv_heads, head_dim, dtype, seed=2), as_tensors(*moves)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("case", list(KERNEL_CASES), ids=list(KERNEL_CASES))
def test_kernel_matches_reference_exactly(case):
    """Several sequences' accepted paths in one call, random trees, scattered pages."""
    pool, moves = accepted_paths_batch(case)
    expected = pool.buffer.clone()
    compact_kv_ref(expected, *moves)
    compact_kv(pool.buffer, *moves)
    assert torch.equal(pool.buffer, expected)


@pytest.mark.triton_interpreter
def test_no_moves_is_a_no_op():
    pool = random_pool(2, 1, 4, 1, 8, torch.bfloat16)
    before = pool.buffer.clone()
    compact_kv(pool.buffer, *as_tensors([], [], [], []))
    assert torch.equal(pool.buffer, before)


@pytest.mark.triton_interpreter
def test_tree_verify_then_compact_gives_causal_attention():
    """After compaction, the accepted path attended causally equals what each path node saw in the tree."""
    page_size, layer = 4, 1
    pool = random_pool(8, 3, page_size, 2, 16, torch.float32, seed=5)
    pages, committed_len = [6, 1, 4, 0, 3], 7
    parents = [-1, 0, 0, 1, 2, 2, 4, 3, 6, 5, 8]  # path to node 10: 0, 2, 4, 6, 8, 10
    path = [0, 2, 4, 6, 8, 10]
    tree_len = len(parents)
    q = torch.randn(tree_len, 4, 16, generator=torch.Generator().manual_seed(6))
    args = (pool.k_cache(layer), pool.v_cache(layer))
    tree_meta = AttentionMetadata.build([tree_len], [committed_len + tree_len], [pages], page_size,
                                        tree_masks=[ancestor_mask(parents)])
    tree_out = paged_attention_ref(q, *args, tree_meta.qo_indptr, tree_meta.kv_lens, tree_meta.page_table, 0.25,
                                   tree_meta.tree_mask, tree_meta.tree_mask_indptr)

    compact_kv(pool.buffer, *as_tensors(*path_slot_moves(pages, committed_len, path, page_size)))
    chain = AttentionMetadata.build([len(path)], [committed_len + len(path)], [pages], page_size)
    chain_out = paged_attention_ref(q[path], *args, chain.qo_indptr, chain.kv_lens, chain.page_table, 0.25)
    torch.testing.assert_close(chain_out, tree_out[path], atol=1e-5, rtol=1e-5)
