"""Multi-head latent attention over the paged latent rows (specpd/kv/latent_pool.py), absorbed.

With kv_b_proj's per-head blocks W_UK [H, dn, r] and W_UV [H, dv, r] absorbed into the query and the output
(DeepSeek-V2 §2.1.2), head h of a query attends over the latent rows themselves:
    q_abs[h] = [q_nope[h] W_UK[h] | rope(q_pe[h])]           [r + dr]
    score(t) = q_abs[h] . row_t * sm_scale                   row_t = [c_kv_t | rope(k_pe_t)]
    out_lat[h] = sum_t softmax(score)_t c_kv_t                [r], then out[h] = out_lat[h] W_UV[h]^T  [dv]
That is multi-query attention with one KV head whose keys are the rows and whose values are the rows' c_kv part:
this backend runs a dense backend over the latent pool with the rows as both K and V, and keeps the first
kv_lora_rank dims of each output. `--attention-backend cpu` (the CPU default) takes the fused C kernel
(specpd/kernels/cpu_attention.py) where the shape fits it (row_width <= 256, heads <= 16: a row then computes the
same in any batch, so a verify row equals its decode row bit for bit, as with the dense models); otherwise, and
for `torch`, TorchAttentionBackend (SDPA over padded batches: exact up to rounding, not batch invariant). Every row kind takes it, absorbed: prefill chunks, decode rows,
tree-verify and tree-draft rows (their tree masks as AttentionMetadata describes them), so a verify row computes
what the decode row at its position computes. (An absorbed prefill does r + dr multiply-adds per head and key where
an expanded one does dn + dr; this engine keeps one path, and only the rows are ever cached.)
`mla_attention_ref` is the pure-torch reference (paged_attention_ref over the rows).
"""
from __future__ import annotations

import torch

from specpd.attention.base import AttentionBackend
from specpd.attention.cpu_backend import CpuAttentionBackend
from specpd.attention.metadata import AttentionMetadata
from specpd.attention.reference import paged_attention_ref
from specpd.attention.torch_backend import TorchAttentionBackend
from specpd.kernels import cpu_attention
from specpd.kv.latent_pool import LatentKVPool


def mla_attention_ref(q_abs: torch.Tensor, rows: torch.Tensor, kv_lora_rank: int, qo_indptr: torch.Tensor,
                      kv_lens: torch.Tensor, page_table: torch.Tensor, sm_scale: float,
                      tree_mask: torch.Tensor | None = None, tree_mask_indptr: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """q_abs [T, H, W], rows [num_pages, page_size, W] (a layer's latent rows) -> out_lat [T, H, kv_lora_rank]."""
    cache = rows.unsqueeze(2)  # [num_pages, page_size, 1, W]: one KV head, keys and values alike
    out = paged_attention_ref(q_abs, cache, cache, qo_indptr, kv_lens, page_table, sm_scale, tree_mask,
                              tree_mask_indptr)
    return out[..., :kv_lora_rank]


CPU_KERNEL_MAX_DIM, CPU_KERNEL_MAX_GROUP = 256, 16  # csrc/cpu_attention.c DMAX, GMAX


class _RowsAsKV:
    """The latent pool as the C kernel's MQA pool: its page-major buffer [num_pages, layers, 2, page_size, 1,
    row_width] with the K and V slots on the same row (a zero stride: writing K and V writes the row twice)."""

    def __init__(self, pool: LatentKVPool):
        b = pool.buffer
        self.pool, self.dtype, self.kv_heads, self.page_size = pool, pool.dtype, 1, pool.page_size
        w = pool.row_width
        self.buffer = pool.storage.as_strided((pool.num_pages, pool.num_layers, 2, pool.page_size, 1, w),
                                              (b.stride(0), b.stride(1), 0, w, w, 1), b.storage_offset())

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.pool.k_cache(layer)

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.pool.v_cache(layer)

    def write(self, layer, k, v, pages, offsets) -> None:
        self.pool.write(layer, k, v, pages, offsets)


class MLAAttentionBackend(AttentionBackend):
    """The latent pool's backend: `plan` once per step, `forward_latent` per layer (module docstring)."""

    name = "mla"

    def __init__(self, kv_pool: LatentKVPool, num_q_heads: int, kv_lora_rank: int, sm_scale: float,
                 kernel: str = "torch"):
        super().__init__(kv_pool, num_q_heads, kv_pool.row_width, sm_scale)
        self.kv_lora_rank = kv_lora_rank
        fits = kv_pool.row_width <= CPU_KERNEL_MAX_DIM and num_q_heads <= CPU_KERNEL_MAX_GROUP
        if kernel == "cpu" and fits and kv_pool.storage.device.type == "cpu" and cpu_attention.available():
            self.inner = CpuAttentionBackend(_RowsAsKV(kv_pool), num_q_heads, kv_pool.row_width, sm_scale)
        else:
            self.inner = TorchAttentionBackend(kv_pool, num_q_heads, kv_pool.row_width, sm_scale)

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        return self.inner.plan(meta)

    def forward(self, q, k, v, layer_id, meta):
        return self.inner.forward(q, k, v, layer_id, meta)

    def forward_latent(self, q_abs: torch.Tensor, rows: torch.Tensor, layer_id: int, meta: AttentionMetadata,
                       out_rows=None) -> torch.Tensor:
        """q_abs [T, H, row_width], rows [T, 1, row_width] (this step's latent rows, written at meta's slots) ->
        out_lat [T', H, kv_lora_rank]. out_rows (an OutputRows): every row is written, only out_rows.index
        attend (as out_rows.meta describes them)."""
        if out_rows is not None:
            self.kv_pool.write(layer_id, rows, rows, meta.write_pages, meta.write_offsets)
            q_abs, rows, meta = q_abs[out_rows.index], rows[out_rows.index], out_rows.meta  # rows there: again
        return self.inner.forward(q_abs.contiguous(), rows, rows, layer_id, meta)[..., :self.kv_lora_rank]


__all__ = ["MLAAttentionBackend", "mla_attention_ref"]
