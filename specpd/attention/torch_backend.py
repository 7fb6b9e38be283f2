"""Torch attention backend: the CPU serving path. Same math as reference.py, batched with SDPA.

Short query blocks (decode rows, tree verify / draft steps, small chunks) are padded into one batch
and attended with one SDPA call over their gathered pages and a [batch, q_max, kv_max] mask; each
long prefill/extend sequence is attended on its own (plain causal when it has no prefix). Masks
follow AttentionMetadata: the prefix is visible, then causal, or the sequence's tree block.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specpd.attention.base import AttentionBackend
from specpd.attention.metadata import AttentionMetadata

SHORT_Q = 32  # query blocks up to this length share one padded SDPA call


@dataclass
class _Padded:
    rows: torch.Tensor  # [B, q_max] long, token rows of each sequence's queries (padding: 0)
    valid: torch.Tensor  # [B, q_max] bool
    pages: torch.Tensor  # [B, n_pages] long
    mask: torch.Tensor  # [B, 1, q_max, n_pages * page_size] bool, True = attend


@dataclass
class _TorchPlan:
    padded: _Padded | None
    # (token_start, token_end, page ids [n_pages] long, kv_len, mask [q_len, kv_len] or None = causal)
    long: list[tuple[int, int, torch.Tensor, int, torch.Tensor | None]]


def _tree_block(meta: AttentionMetadata, tree_indptr: list[int] | None, b: int) -> torch.Tensor | None:
    if tree_indptr is None or tree_indptr[b + 1] == tree_indptr[b]:
        return None
    return meta.tree_mask[tree_indptr[b]:tree_indptr[b + 1]].view(meta.q_lens_host[b], -1)  # [q_len, width]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        indptr = meta.qo_indptr.tolist()
        tree_indptr = meta.tree_mask_indptr.tolist() if meta.tree_mask is not None else None
        short = [b for b, q in enumerate(meta.q_lens_host) if 0 < q <= SHORT_Q]
        long = []
        for b, q_len in enumerate(meta.q_lens_host):
            if q_len <= SHORT_Q:
                continue
            kv_len = meta.kv_lens_host[b]
            tree = _tree_block(meta, tree_indptr, b)
            mask = None
            if tree is not None:
                prefix = torch.ones(q_len, kv_len - tree.shape[1], dtype=torch.bool, device=tree.device)
                mask = torch.cat([prefix, tree], dim=1)  # [q_len, kv_len]
            elif kv_len != q_len:
                q_pos = torch.arange(kv_len - q_len, kv_len).unsqueeze(1)
                mask = torch.arange(kv_len).unsqueeze(0) <= q_pos
            n_pages = (kv_len + meta.page_size - 1) // meta.page_size
            long.append((indptr[b], indptr[b + 1], meta.page_table[b, :n_pages].long(), kv_len, mask))
        meta.plan = _TorchPlan(self._plan_padded(meta, short, indptr, tree_indptr) if short else None, long)
        return meta

    @staticmethod
    def _plan_padded(meta, seqs: list[int], indptr: list[int], tree_indptr) -> _Padded:
        q_lens = [meta.q_lens_host[b] for b in seqs]
        kv_lens = [meta.kv_lens_host[b] for b in seqs]
        q_max, kv_max = max(q_lens), max(kv_lens)
        n_pages = (kv_max + meta.page_size - 1) // meta.page_size
        idx = torch.tensor(seqs)
        q_len_t = torch.tensor(q_lens).view(-1, 1, 1)
        kv_len_t = torch.tensor(kv_lens).view(-1, 1, 1)
        j = torch.arange(q_max).view(1, -1, 1)
        k_pos = torch.arange(n_pages * meta.page_size).view(1, 1, -1)
        mask = k_pos <= kv_len_t - q_len_t + j  # causal with prefix offset: [B, q_max, kv_slots]
        for i, b in enumerate(seqs):
            tree = _tree_block(meta, tree_indptr, b)
            if tree is not None:
                q_len, kv_len, width = q_lens[i], kv_lens[i], tree.shape[1]
                mask[i, :q_len, :kv_len - width] = True
                mask[i, :q_len, kv_len - width:kv_len] = tree.to(mask.device)
        valid = j.view(1, -1) < q_len_t.view(-1, 1)  # [B, q_max]
        mask[~valid] = False
        mask[:, :, 0] |= ~valid  # padding rows attend to one slot (no NaN); their output is dropped
        rows = torch.tensor(indptr[:-1])[idx].view(-1, 1) + torch.arange(q_max).view(1, -1)
        rows = torch.where(valid, rows, torch.zeros_like(rows))
        return _Padded(rows, valid, meta.page_table[idx, :n_pages].long(), mask.unsqueeze(1))

    def forward(self, q, k, v, layer_id, meta):
        pool = self.kv_pool
        pool.write(layer_id, k, v, meta.write_pages, meta.write_offsets)
        k_cache, v_cache = pool.k_cache(layer_id), pool.v_cache(layer_id)
        plan: _TorchPlan = meta.plan
        out = torch.empty_like(q)
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        if plan.padded is not None:
            pad = plan.padded
            nb = pad.pages.shape[0]
            kb = k_cache[pad.pages].reshape(nb, -1, hkv, d).transpose(1, 2).to(q.dtype)  # [B, Hkv, S, D]
            vb = v_cache[pad.pages].reshape(nb, -1, hkv, d).transpose(1, 2).to(q.dtype)
            qb = q[pad.rows].transpose(1, 2)  # [B, Hq, q_max, D]
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=pad.mask, scale=self.sm_scale,
                                                enable_gqa=True)
            out[pad.rows[pad.valid]] = ob.transpose(1, 2)[pad.valid]
        for start, end, pages, kv_len, mask in plan.long:
            kb = k_cache[pages].reshape(-1, hkv, d)[:kv_len].transpose(0, 1).to(q.dtype)
            vb = v_cache[pages].reshape(-1, hkv, d)[:kv_len].transpose(0, 1).to(q.dtype)
            qb = q[start:end].transpose(0, 1)  # [Hq, q_len, D]
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=mask is None,
                                                scale=self.sm_scale, enable_gqa=True)
            out[start:end] = ob.transpose(0, 1)
        return out
