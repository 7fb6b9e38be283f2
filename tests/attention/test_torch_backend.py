"""The torch backend's batched plan (padded groups, folded GQA masks, long sequences) against the
one-sequence-at-a-time reference, on ragged batches with scattered pages, lengths at page boundaries,
page sizes 1 / 4 / 16 and tree masks (square verify blocks and wider draft-step blocks)."""
from __future__ import annotations

import pytest
import torch

from specpd.attention.metadata import AttentionMetadata
from specpd.attention.reference import paged_attention_ref
from specpd.attention.torch_backend import TorchAttentionBackend
from specpd.kv.pool import KVPool

LAYER = 1  # middle layer of 3: a strided per-layer view


def tree_block(q_len: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """A random ancestor-or-self relation over q_len nodes, with width - q_len scratch slots in front."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, q_len)]
    mask = torch.zeros(q_len, width, dtype=torch.bool)
    off = width - q_len
    for i in range(q_len):
        j = i
        while j >= 0:
            mask[i, off + j] = True
            j = parents[j]
    if off:
        mask[:, :off] = torch.rand(q_len, off, generator=gen) < 0.5
    return mask


def run_case(q_lens, kv_lens, page_size, num_q_heads, num_kv_heads, trees=None, seed=0, head_dim=16):
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-kv // page_size) for kv in kv_lens]
    num_pages = sum(pages_per_seq) + 3
    pool = KVPool(num_pages, 3, page_size, num_kv_heads, head_dim, torch.float32)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen))
    perm = torch.randperm(num_pages, generator=gen).tolist()
    page_lists, used = [], 0
    for n in pages_per_seq:
        page_lists.append(perm[used:used + n])
        used += n
    tree_masks = None
    if trees:
        tree_masks = [tree_block(q, q + extra, gen) if extra is not None else None
                      for q, extra in zip(q_lens, trees)]
    meta = AttentionMetadata.build(q_lens, kv_lens, page_lists, page_size, tree_masks=tree_masks)
    total = sum(q_lens)
    q = torch.randn(total, num_q_heads, head_dim, generator=gen)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    backend = TorchAttentionBackend(pool, num_q_heads, head_dim)
    backend.plan(meta)
    out = backend.forward(q, k, v, LAYER, meta)  # writes k/v first, then attends
    ref = paged_attention_ref(q, pool.k_cache(LAYER), pool.v_cache(LAYER), meta.qo_indptr, meta.kv_lens,
                              meta.page_table, backend.sm_scale, meta.tree_mask, meta.tree_mask_indptr)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


CASES = {  # q_lens, kv_lens, page_size, Hq, Hkv, trees (extra scratch width per sequence, None = causal)
    "decode_b1_p16": ([1], [500], 16, 9, 3, None),
    "decode_ragged_p4": ([1, 1, 1, 1], [3, 4, 5, 130], 4, 6, 2, None),
    "verify_chain_b1_p16_boundary": ([8], [512], 16, 9, 3, None),
    "verify_chain_ragged_p1": ([2, 5, 3], [7, 40, 3], 1, 4, 1, None),
    "verify_mixed_q_p4": ([5, 1, 8, 3], [9, 33, 64, 8], 4, 6, 3, None),
    "verify_tree_b1_p16": ([8], [508], 16, 9, 3, [0]),
    "verify_tree_ragged_p4": ([8, 5, 1, 3], [20, 17, 4, 100], 4, 6, 2, [0, 0, None, 0]),
    "draft_tree_wide_p16": ([3, 3, 2], [40, 33, 18], 16, 9, 3, [6, 3, 2]),
    "mha_no_fold_p4": ([4, 2], [16, 5], 4, 2, 2, [0, None]),
    "long_and_short_p16": ([40, 1, 8], [40, 300, 57], 16, 6, 2, None),
    "extend_after_prefix_p4": ([33, 2], [70, 9], 4, 4, 2, None),
    "long_tree_p1": ([34, 2], [50, 9], 1, 4, 2, [0, None]),
    # an adaptive round: decode rows batched apart from the one request that speculates
    "decode_rows_and_one_tree_p16": ([1, 1, 3, 1, 1, 1], [16, 17, 250, 33, 32, 1], 16, 9, 3,
                                     [None, None, 0, None, None, None]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_backend_matches_reference(name):
    q_lens, kv_lens, page_size, hq, hkv, trees = CASES[name]
    run_case(q_lens, kv_lens, page_size, hq, hkv, trees)


@pytest.mark.parametrize("seed", range(6))
def test_torch_backend_random_batches(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    batch = int(torch.randint(1, 7, (1,), generator=gen))
    page_size = [1, 4, 16][seed % 3]
    q_lens = [int(torch.randint(1, 10, (1,), generator=gen)) for _ in range(batch)]
    kv_lens = [q + int(torch.randint(0, 80, (1,), generator=gen)) for q in q_lens]
    trees = [0 if torch.rand(1, generator=gen) < 0.5 else None for _ in q_lens] if seed % 2 else None
    run_case(q_lens, kv_lens, page_size, 6, 2, trees, seed=seed)
