"""CPU attention backend: one C call per layer (specpd/kernels/cpu_attention.py) that writes the step's K/V
into the pool, applies RoPE to Q and K, and attends over the pages in place with the step's causal or tree
masks. The model hands it the fused qkv projection and the step's RopeBatch (`attend`), so RoPE, the KV
write, the page reads and the mask cost no torch op of their own. `forward` (already-rotated q, k, v) is
there for callers that rotate themselves. The torch backend stays the reference.

Long prompt chunks in half precision: a sequence with at least PREFILL_SDPA_ROWS query rows and
PREFILL_SDPA_WORK query-key pairs, no tree mask, in a bf16 or fp16 pool, attends through torch's SDPA (its CPU flash attention runs the products as bf16 GEMMs, on
AMX where the CPU has it, faster than the C kernel there: evals/results/kernels_attention.json) over its pages
gathered once per layer; the C kernel still writes every row's K/V and attends every other row. Decode and
verify rows never take that path, so a verify row still equals the decode row bit for bit; a prompt row's
arithmetic was never a decode row's in half precision (a 512-row GEMM rounds otherwise than a 1-row one). fp32
pools keep the C kernel for every row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specpd.attention.base import AttentionBackend
from specpd.attention.metadata import AttentionMetadata
from specpd.attention.reference import rope_ref
from specpd.kernels import cpu_attention
from specpd.kernels.cpu_attention import Prepared, paged_attention

# a prompt chunk this large (half precision, no tree) attends through torch's SDPA: below about this size its
# fixed costs (RoPE on q in torch, the page gather, the mask) lose to the kernel's
PREFILL_SDPA_ROWS = 64
PREFILL_SDPA_WORK = 384 * 384
HALF = (torch.bfloat16, torch.float16)


@dataclass
class _LongRows:
    """A prompt chunk attended by SDPA: its rows [start, end) of the step, its pages, its visible keys."""
    start: int
    end: int
    pages: torch.Tensor  # [n_pages] int64
    kv_len: int
    mask: torch.Tensor  # [q_len, kv_len] bool, query j sees keys <= kv_len - q_len + j


@dataclass
class _CpuPlan:
    write_slots: torch.Tensor  # [num_tokens] int64, page * page_size + offset of each new token's K/V
    tree_mask: torch.Tensor | None  # [sum q_len_b * width_b] bool (AttentionMetadata.tree_mask)
    tree_indptr: torch.Tensor | None  # [batch + 1] int32
    prepared: Prepared  # every layer's call: these slots, this batch's queries
    rows: tuple | None = None  # (rows.meta, Prepared): a forward whose last layer attends some rows only
    long: list[_LongRows] | None = None  # prompt chunks for SDPA; then `prepared` attends the other rows
    short_index: torch.Tensor | None = None  # [R] int64: the rows `prepared` attends (None: none does)


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"
    fallback = "torch"

    @classmethod
    def unavailable(cls) -> str | None:
        """Why the C kernel is missing (its build's logged error), or None: it loaded."""
        return None if cpu_attention.available() else cpu_attention.why_unavailable()

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        slots = meta.write_pages * meta.page_size + meta.write_offsets
        tree = meta.tree_mask.contiguous() if meta.tree_mask is not None else None
        indptr = meta.tree_mask_indptr if tree is not None else None
        long = [] if tree is not None or self.kv_pool.dtype not in HALF else \
            [b for b, (q, kv) in enumerate(zip(meta.q_lens_host, meta.kv_lens_host))
             if q >= PREFILL_SDPA_ROWS and q * kv >= PREFILL_SDPA_WORK]
        if long:
            meta.plan = self._plan_with_long(meta, slots, long)
            return meta
        prepared = Prepared(self.kv_pool.buffer, self.num_q_heads, self.sm_scale, slots, meta.qo_indptr,
                            meta.kv_lens, meta.page_table, tree, indptr)
        meta.plan = _CpuPlan(slots, tree, indptr, prepared)
        return meta

    def _plan_with_long(self, meta: AttentionMetadata, slots: torch.Tensor, long: list[int]) -> _CpuPlan:
        """The kernel writes every row's K/V and attends the rows of the other sequences; SDPA the long ones."""
        starts = meta.qo_indptr.tolist()
        chunks = []
        for b in long:
            q_len, kv_len = meta.q_lens_host[b], meta.kv_lens_host[b]
            n_pages = -(-kv_len // meta.page_size)
            mask = torch.arange(kv_len).unsqueeze(0) <= torch.arange(kv_len - q_len, kv_len).unsqueeze(1)
            chunks.append(_LongRows(starts[b], starts[b + 1], meta.page_table[b, :n_pages].long(), kv_len, mask))
        short = sorted(set(range(meta.batch_size)) - set(long))
        short_index = None
        if short:
            short_index = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in short])
            q_lens = [0] + [meta.q_lens_host[b] for b in short]
            qo = torch.tensor(q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            idx = torch.tensor(short)
            prepared = Prepared(self.kv_pool.buffer, self.num_q_heads, self.sm_scale, slots, qo,
                                meta.kv_lens[idx].contiguous(), meta.page_table[idx].contiguous(), None, None)
        else:  # only the write: the tables of the whole batch serve (no row attends)
            prepared = Prepared(self.kv_pool.buffer, self.num_q_heads, self.sm_scale, slots, meta.qo_indptr,
                                meta.kv_lens, meta.page_table, None, None)
        return _CpuPlan(slots, None, None, prepared, long=chunks, short_index=short_index)

    def _plan(self, meta: AttentionMetadata) -> _CpuPlan:
        return meta.plan if isinstance(meta.plan, _CpuPlan) else self.plan(meta).plan

    def attend(self, qkv: torch.Tensor, rope, layer_id: int, meta: AttentionMetadata, rows=None) -> torch.Tensor:
        """qkv [T, Hq + 2 Hkv, D] unrotated, rope: the step's RopeBatch -> out [T', Hq * D] (T' = T, or the
        rows of `rows`: every row's K/V is written, only those rows attend, as rows.meta describes them)."""
        plan = self._plan(meta)
        if not qkv.is_contiguous():
            qkv = qkv.contiguous()
        if rows is None and plan.long:
            return self._attend_with_long(qkv, rope, layer_id, plan)
        if rows is None:
            return plan.prepared.run(qkv, rope.positions, rope.cos, rope.signed_sin, layer_id)
        q = qkv[rows.index, :self.num_q_heads]  # [R, Hq, D], a copy
        return self.rows_prepared(plan, rows.meta).run(qkv, rope.positions, rope.cos, rope.signed_sin, layer_id,
                                                       q=q, q_pos=rope.positions[rows.index])

    def rows_prepared(self, plan: _CpuPlan, q_meta: AttentionMetadata) -> Prepared:
        """The kernel call of a step whose every row writes its K/V (plan's slots) and only `q_meta`'s rows attend
        (OutputRows), built once per step and kept on the plan."""
        if plan.rows is None or plan.rows[0] is not q_meta:
            tree = q_meta.tree_mask.contiguous() if q_meta.tree_mask is not None else None
            plan.rows = (q_meta, Prepared(self.kv_pool.buffer, self.num_q_heads, self.sm_scale, plan.write_slots,
                                          q_meta.qo_indptr, q_meta.kv_lens, q_meta.page_table, tree,
                                          q_meta.tree_mask_indptr if tree is not None else None))
        return plan.rows[1]

    def _attend_with_long(self, qkv: torch.Tensor, rope, layer_id: int, plan: _CpuPlan) -> torch.Tensor:
        hq, pos = self.num_q_heads, rope.positions
        out = torch.empty(qkv.shape[0], hq * self.head_dim, dtype=qkv.dtype)
        if plan.short_index is None:
            plan.prepared.write(qkv, pos, rope.cos, rope.signed_sin, layer_id)
        else:
            idx = plan.short_index
            out[idx] = plan.prepared.run(qkv, pos, rope.cos, rope.signed_sin, layer_id, q=qkv[idx, :hq],
                                         q_pos=pos[idx])
        k_cache, v_cache = self.kv_pool.k_cache(layer_id), self.kv_pool.v_cache(layer_id)
        for c in plan.long:  # every row's K (RoPE'd) is in the pool now, this chunk's own included
            q = rope_ref(qkv[c.start:c.end, :hq], pos[c.start:c.end], rope.cos, rope.signed_sin).to(qkv.dtype)
            k = k_cache.index_select(0, c.pages).flatten(0, 1)[:c.kv_len]  # [kv_len, Hkv, D]
            v = v_cache.index_select(0, c.pages).flatten(0, 1)[:c.kv_len]
            o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                               v.transpose(0, 1).unsqueeze(0), attn_mask=c.mask,
                                               scale=self.sm_scale, enable_gqa=True)  # [1, Hq, q_len, D]
            out[c.start:c.end] = o[0].transpose(0, 1).reshape(c.end - c.start, -1)
        return out

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
