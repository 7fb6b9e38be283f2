"""CPU attention backend: one C call per layer (specpd/kernels/cpu_attention.py) that writes the step's K/V
into the pool, applies RoPE to Q and K, and attends over the pages in place with the step's causal or tree
masks. The model hands it the fused qkv projection and the step's RopeBatch (`attend`), so RoPE, the KV
write, the page reads and the mask cost no torch op of their own. `forward` (already-rotated q, k, v) is
there for callers that rotate themselves. The torch backend stays the reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specpd.attention.base import AttentionBackend
from specpd.attention.metadata import AttentionMetadata
from specpd.kernels.cpu_attention import Prepared, paged_attention


@dataclass
class _CpuPlan:
    write_slots: torch.Tensor  # [num_tokens] int64, page * page_size + offset of each new token's K/V
    tree_mask: torch.Tensor | None  # [sum q_len_b * width_b] bool (AttentionMetadata.tree_mask)
    tree_indptr: torch.Tensor | None  # [batch + 1] int32
    prepared: Prepared  # every layer's call: these slots, this batch's queries
    rows: tuple | None = None  # (rows.meta, Prepared): a forward whose last layer attends some rows only


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        slots = meta.write_pages * meta.page_size + meta.write_offsets
        tree = meta.tree_mask.contiguous() if meta.tree_mask is not None else None
        indptr = meta.tree_mask_indptr if tree is not None else None
        prepared = Prepared(self.kv_pool.buffer, self.num_q_heads, self.sm_scale, slots, meta.qo_indptr,
                            meta.kv_lens, meta.page_table, tree, indptr)
        meta.plan = _CpuPlan(slots, tree, indptr, prepared)
        return meta

    def _plan(self, meta: AttentionMetadata) -> _CpuPlan:
        return meta.plan if isinstance(meta.plan, _CpuPlan) else self.plan(meta).plan

    def attend(self, qkv: torch.Tensor, rope, layer_id: int, meta: AttentionMetadata, rows=None) -> torch.Tensor:
        """qkv [T, Hq + 2 Hkv, D] unrotated, rope: the step's RopeBatch -> out [T', Hq * D] (T' = T, or the
        rows of `rows`: every row's K/V is written, only those rows attend, as rows.meta describes them)."""
        plan = self._plan(meta)
        if not qkv.is_contiguous():
            qkv = qkv.contiguous()
        if rows is None:
            return plan.prepared.run(qkv, rope.positions, rope.cos, rope.signed_sin, layer_id)
        if plan.rows is None or plan.rows[0] is not rows.meta:
            q_meta = rows.meta
            tree = q_meta.tree_mask.contiguous() if q_meta.tree_mask is not None else None
            plan.rows = (q_meta, Prepared(self.kv_pool.buffer, self.num_q_heads, self.sm_scale, plan.write_slots,
                                          q_meta.qo_indptr, q_meta.kv_lens, q_meta.page_table, tree,
                                          q_meta.tree_mask_indptr if tree is not None else None))
        q = qkv[rows.index, :self.num_q_heads]  # [R, Hq, D], a copy
        return plan.rows[1].run(qkv, rope.positions, rope.cos, rope.signed_sin, layer_id, q=q,
                                q_pos=rope.positions[rows.index])
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                meta: AttentionMetadata) -> torch.Tensor:
        """Already-rotated q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D]."""
        plan = self._plan(meta)
        qc, kc, vc = (t.contiguous() if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] else t for t in (q, k, v))
        if kc.stride(0) != vc.stride(0):
            kc, vc = kc.contiguous(), vc.contiguous()
        out = paged_attention(qc, None, kc, vc, None, plan.write_slots, None, None, self.kv_pool.buffer, layer_id,
                              meta.qo_indptr, meta.kv_lens, meta.page_table, plan.tree_mask, plan.tree_indptr,
                              self.num_q_heads, self.sm_scale)
        return out.view(q.shape)
