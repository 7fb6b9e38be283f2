"""Torch attention backend: the CPU serving path. Same math as reference.py, batched with SDPA.

Decode rows (one query each) are attended together over their gathered pages with a length mask;
each prefill/extend sequence is attended on its own with a causal-with-offset mask, or, for tree
verify, the prefix plus its tree block (see AttentionMetadata). A one-token tree is plain decode.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specpd.attention.base import AttentionBackend
from specpd.attention.metadata import AttentionMetadata


@dataclass
class _TorchPlan:
    decode_rows: torch.Tensor | None  # [num_decode] token rows of single-query sequences
    decode_pages: torch.Tensor | None  # [num_decode, max_pages] int64
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_pages * page_size] bool, True = attend
    # (token_start, token_end, page ids [n_pages] int64, kv_len, mask [q_len, kv_len] or None for plain causal)
    extends: list[tuple[int, int, torch.Tensor, int, torch.Tensor | None]]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        page_size = meta.page_size
        indptr = meta.qo_indptr.tolist()
        tree_indptr = meta.tree_mask_indptr.tolist() if meta.tree_mask is not None else None
        has_tree = [tree_indptr is not None and tree_indptr[b + 1] > tree_indptr[b] for b in range(meta.batch_size)]
        decode_seqs = [b for b, q in enumerate(meta.q_lens_host) if q == 1 and not has_tree[b]]
        decode_rows = decode_pages = decode_mask = None
        if decode_seqs:
            idx = torch.tensor(decode_seqs)
            max_kv = max(meta.kv_lens_host[b] for b in decode_seqs)
            n_pages = (max_kv + page_size - 1) // page_size
            decode_rows = torch.tensor([indptr[b] for b in decode_seqs])
            decode_pages = meta.page_table[idx, :n_pages].long()
            kv = meta.kv_lens[idx].long().unsqueeze(1)
            decode_mask = (torch.arange(n_pages * page_size).unsqueeze(0) < kv)[:, None, None, :]
        extends = []
        for b, q_len in enumerate(meta.q_lens_host):
            if q_len == 0 or (q_len == 1 and not has_tree[b]):
                continue
            kv_len = meta.kv_lens_host[b]
            n_pages = (kv_len + page_size - 1) // page_size
            mask = None
            if has_tree[b]:
                tree = meta.tree_mask[tree_indptr[b]:tree_indptr[b + 1]].view(q_len, -1)  # [q_len, width]
                prefix = torch.ones(q_len, kv_len - tree.shape[1], dtype=torch.bool, device=tree.device)
                mask = torch.cat([prefix, tree], dim=1)  # [q_len, kv_len]
            elif kv_len != q_len:
                q_pos = torch.arange(kv_len - q_len, kv_len).unsqueeze(1)
                mask = torch.arange(kv_len).unsqueeze(0) <= q_pos
            extends.append((indptr[b], indptr[b + 1], meta.page_table[b, :n_pages].long(), kv_len, mask))
        meta.plan = _TorchPlan(decode_rows, decode_pages, decode_mask, extends)
        return meta

    def forward(self, q, k, v, layer_id, meta):
        pool = self.kv_pool
        pool.write(layer_id, k, v, meta.write_pages, meta.write_offsets)
        k_cache, v_cache = pool.k_cache(layer_id), pool.v_cache(layer_id)
        plan: _TorchPlan = meta.plan
        out = torch.empty_like(q)
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        if plan.decode_rows is not None:
            nd = plan.decode_rows.shape[0]
            kd = k_cache[plan.decode_pages].reshape(nd, -1, hkv, d).transpose(1, 2).to(q.dtype)
            vd = v_cache[plan.decode_pages].reshape(nd, -1, hkv, d).transpose(1, 2).to(q.dtype)
            qd = q[plan.decode_rows].unsqueeze(2)  # [nd, Hq, 1, D]
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.decode_mask,
                                                scale=self.sm_scale, enable_gqa=True)
            out[plan.decode_rows] = od.squeeze(2)
        for start, end, pages, kv_len, mask in plan.extends:
            kb = k_cache[pages].reshape(-1, hkv, d)[:kv_len].transpose(0, 1).to(q.dtype)
            vb = v_cache[pages].reshape(-1, hkv, d)[:kv_len].transpose(0, 1).to(q.dtype)
            qb = q[start:end].transpose(0, 1)  # [Hq, q_len, D]
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=mask is None,
                                                scale=self.sm_scale, enable_gqa=True)
            out[start:end] = ob.transpose(0, 1)
        return out
