"""Absorbed MLA over the paged latent rows (specpd/attention/mla.py) against the expanded attention it replaces
(transformers' formula: per-head keys [W_UK c_kv | k_pe] and values W_UV c_kv) and against its torch reference:
a ragged step over scattered pages crossing page boundaries, with a prompt chunk after its prefix, decode rows and
a tree of verify rows; every KV row written is the latent row, once, where the metadata says; on the C kernel
(`cpu`) a verify row equals the decode row at its position bit for bit."""
import random

import pytest
import torch

from specpd.attention.metadata import AttentionMetadata
from specpd.attention.mla import MLAAttentionBackend, mla_attention_ref
from specpd.kv.latent_pool import LatentKVPool

H, DN, DR, DV, R = 4, 6, 4, 5, 9  # heads, nope / rope / value head dims, kv_lora_rank: rows of 13 (+1 pad)
SCALE = (DN + DR) ** -0.5


def expanded_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, visible):
    """transformers' MLA for one sequence: q [n, H, *], c_kv [S, R], k_pe [S, DR], visible [n, S] -> [n, H, DV]."""
    k_nope = torch.einsum("hdr,sr->shd", w_uk, c_kv)  # [S, H, DN]
    values = torch.einsum("hvr,sr->shv", w_uv, c_kv)  # [S, H, DV]
    scores = (torch.einsum("qhd,shd->hqs", q_nope, k_nope) + torch.einsum("qhd,sd->hqs", q_pe, k_pe)) * SCALE
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqs,shv->qhv", probs, values)


@pytest.mark.parametrize("kernel", ["torch", "cpu"])
def test_absorbed_equals_expanded_and_reference_on_a_ragged_tree_step(kernel):
    gen = torch.Generator().manual_seed(0)
    page_size, num_pages = 4, 24
    pool = LatentKVPool(num_pages, 2, page_size, R + DR, torch.float32)
    assert pool.row_width == 14 and pool.latent_dim == 13
    backend = MLAAttentionBackend(pool, H, R, SCALE, kernel)
    assert type(backend.inner).__name__ == ("CpuAttentionBackend" if kernel == "cpu" else "TorchAttentionBackend")
    w_uk, w_uv = torch.randn(H, DN, R, generator=gen), torch.randn(H, DV, R, generator=gen)
    pages = list(range(num_pages))
    random.Random(1).shuffle(pages)
    page_lists = [pages[0:5], pages[5:8], pages[8:12]]
    q_lens, kv_lens = [6, 1, 4], [17, 10, 13]  # a chunk after 11 rows, a decode row, a 4-node tree after 9
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    meta = AttentionMetadata.build(q_lens, kv_lens, page_lists, page_size, tree_masks=[None, None, tree])
    layer = 1
    # the prefixes' rows, already in the pool; this step's rows come with the queries
    c_kv = [torch.randn(kv, R, generator=gen) for kv in kv_lens]
    k_pe = [torch.randn(kv, DR, generator=gen) for kv in kv_lens]
    rows = [torch.cat([c, k, torch.zeros(len(c), 1)], dim=-1) for c, k in zip(c_kv, k_pe)]
    for b, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        for pos in range(kv - q):
            pool.latent(layer)[page_lists[b][pos // page_size], pos % page_size] = rows[b][pos]
    q_nope = torch.randn(sum(q_lens), H, DN, generator=gen)
    q_pe = torch.randn(sum(q_lens), H, DR, generator=gen)
    q_abs = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_pe, torch.zeros(sum(q_lens), H, 1)], dim=-1)
    new_rows = torch.cat([r[kv - q:] for r, q, kv in zip(rows, q_lens, kv_lens)]).unsqueeze(1)  # [T, 1, 14]
    backend.plan(meta)
    out_lat = backend.forward_latent(q_abs, new_rows, layer, meta)  # [T, H, R]
    got = torch.einsum("thr,hvr->thv", out_lat, w_uv)
    # every row where the metadata put it, the other layer untouched
    for b, kv in enumerate(kv_lens):
        for pos in range(kv):
            assert torch.equal(pool.latent(layer)[page_lists[b][pos // page_size], pos % page_size], rows[b][pos])
    assert pool.latent(0).abs().sum().item() == 0
    ref = mla_attention_ref(q_abs, pool.latent(layer), R, meta.qo_indptr, meta.kv_lens, meta.page_table, SCALE,
                            meta.tree_mask, meta.tree_mask_indptr)
    assert (out_lat - ref).abs().max().item() < 1e-5
    start = 0
    for b, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        visible = torch.ones(q, kv, dtype=torch.bool)
        visible[:, kv - q:] = tree if b == 2 else torch.ones(q, q, dtype=torch.bool).tril()
        want = expanded_attention(q_nope[start:start + q], q_pe[start:start + q], c_kv[b], k_pe[b], w_uk, w_uv,
                                  visible)
        assert (got[start:start + q] - want).abs().max().item() < 1e-4, f"sequence {b}"
        start += q

    if kernel == "cpu":  # tree node 1 (rows 7 + 1 of the step) == the decode row at its position over its path
        path = torch.cat([new_rows[7:9]])  # nodes 0 and 1: positions 9 and 10 of sequence 2
        decode = AttentionMetadata.build([1], [11], [page_lists[2]], page_size)
        backend.plan(decode)
        alone = backend.forward_latent(q_abs[8:9].clone(), path[1:2], layer, decode)
        assert torch.equal(alone[0], out_lat[8])
