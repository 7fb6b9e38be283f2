"""Triton attention backend: paged split-K decode and ragged paged extend over the page-major pool.

All-decode batches (every q_len == 1) take `paged_decode_attention`; anything else, including a mix
of decode and extend rows, takes `paged_extend_attention`, which handles q_len 1 rows as well. Tree
verify batches pass the metadata's tree mask to the extend kernel (an all-one-token tree is plain
decode). The kernels read the strided per-layer views of the pool directly.

Under a CUDA graph (`plan_static`) every launch's host values come from the batch's shape alone: the grid of
the extend kernel from its fixed rows per request, the decode kernel's KV splits and split length from the
longest KV the graph may see (splits past a sequence's KV are empty and weigh nothing in the merge), and the
kernels read lengths, pages and masks from the graph's fixed buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specpd.attention.base import AttentionBackend
from specpd.attention.metadata import AttentionMetadata
from specpd.kernels.paged_attention import decode_num_splits, paged_decode_attention, paged_extend_attention


@dataclass
class _TritonPlan:
    is_decode: bool
    max_q_len: int
    max_kv_len: int
    num_splits: int  # decode only: KV chunks per sequence


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    static_plan = True

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        # host-side maxima, so that no layer's launch has to sync on the device
        return self.plan_static(meta, meta.max_kv_len)

    def plan_static(self, meta: AttentionMetadata, max_kv_len: int) -> AttentionMetadata:
        num_splits = 1
        decode = _decode_only(meta)
        if decode:
            num_splits = decode_num_splits(meta.batch_size, self.kv_pool.kv_heads, max_kv_len)
        meta.plan = _TritonPlan(decode, meta.max_q_len, max_kv_len, num_splits)
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        pool = self.kv_pool
        pool.write(layer_id, k, v, meta.write_pages, meta.write_offsets)
        k_cache, v_cache = pool.k_cache(layer_id), pool.v_cache(layer_id)
        plan: _TritonPlan = meta.plan if isinstance(meta.plan, _TritonPlan) else self.plan(meta).plan
        if plan.is_decode:
            return paged_decode_attention(q, k_cache, v_cache, meta.kv_lens, meta.page_table, self.sm_scale,
                                          max_kv_len=plan.max_kv_len, num_splits=plan.num_splits)
        return paged_extend_attention(q, k_cache, v_cache, meta.qo_indptr, meta.kv_lens, meta.page_table,
                                      self.sm_scale, max_q_len=plan.max_q_len, tree_mask=meta.tree_mask,
                                      tree_mask_indptr=meta.tree_mask_indptr)


def _decode_only(meta: AttentionMetadata) -> bool:
    """One query per sequence and no tree mask (a tree draft step's single frontier node still sees only its
    ancestors' scratch slots: the extend kernel's masked path)."""
    return meta.is_decode and meta.tree_mask is None
