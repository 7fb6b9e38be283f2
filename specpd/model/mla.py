"""The attention layers of the MoE families: DeepSeek's multi-head latent attention, GLM-4.5's GQA with partial RoPE.

MLAAttention (transformers' DeepseekV3Attention, absorbed; specpd/attention/mla.py has the math):
    q = q_b_proj(q_a_layernorm(q_a_proj(x))) (or q_proj(x))              [T, H, dn + dr]
    c_kv, k_pe = split(kv_a_proj_with_mqa(x), [r, dr]); c_kv = kv_a_layernorm(c_kv)
    row = [c_kv | rope(k_pe)] (+ a zero where r + dr is odd)             the one cached row a token has
    q_abs = [q_nope W_UK | rope(q_pe)]; out = o_proj(attend(q_abs, rows) W_UV^T)
W_UK / W_UV come from the checkpoint's kv_b_proj [H * (dn + dv), r] split at load (`split_kv_b`) into one linear per
head each (w_uk.{h}: [r, dn] = W_UK[h]^T, w_uv.{h}: [dv, r]), so the CPU path packs them: a head's product is the
project's batch-invariant GEMM, and a verify row's attention input equals the decode row's bit for bit. The latent
norms keep transformers' eps 1e-6.
GQAPartialRopeAttention (Glm4MoeAttention): fused q/k/v (bias), per-head q/k RMSNorm where use_qk_norm, RoPE on the
first rope_dim dims of each head; attends through the configured backend's `forward` over a KVPool.
"""
from __future__ import annotations

import torch
from torch import nn

from specpd.attention.base import AttentionBackend
from specpd.attention.metadata import AttentionMetadata
from specpd.config import ModelConfig
from specpd.model.llama import OutputRows, RMSNorm, RopeBatch, apply_linear
from specpd.model.rope_scaling import rope_rotary_dims

LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default; transformers builds q_a / kv_a layernorms without the config's eps


def split_kv_b(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """`weights` with every `*.self_attn.kv_b_proj.weight` [H * (dn + dv), r] replaced by its per-head pieces
    `*.self_attn.w_uk.{h}.weight` (W_UK[h]^T, [r, dn]) and `*.self_attn.w_uv.{h}.weight` (W_UV[h], [dv, r])."""
    keys = [k for k in weights if k.endswith("self_attn.kv_b_proj.weight")]
    if not keys:
        return weights
    mla, out = cfg.mla, dict(weights)
    for key in keys:
        pre = key[:-len("kv_b_proj.weight")]
        w = out.pop(key).view(cfg.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        for h in range(cfg.num_heads):
            out[f"{pre}w_uk.{h}.weight"] = w[h, :mla.qk_nope_head_dim].T.contiguous()
            out[f"{pre}w_uv.{h}.weight"] = w[h, mla.qk_nope_head_dim:].contiguous()
    return out


class MLAAttention(nn.Module):
    tp = None  # never sharded: specpd/model/tp.py refuses MLA above TP 1

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        mla, hidden = cfg.mla, cfg.hidden_size
        self.layer_id = layer_id
        self.num_heads = cfg.num_heads
        self.nope, self.rope, self.v_dim, self.rank = (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim,
                                                       mla.kv_lora_rank)
        self.interleaved = mla.rope_interleave
        q_out = cfg.num_heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.w_uk = nn.ModuleList(nn.Linear(mla.qk_nope_head_dim, mla.kv_lora_rank, bias=False)
                                  for _ in range(cfg.num_heads))
        self.w_uv = nn.ModuleList(nn.Linear(mla.kv_lora_rank, mla.v_head_dim, bias=False)
                                  for _ in range(cfg.num_heads))
        self.o_proj = nn.Linear(cfg.num_heads * mla.v_head_dim, hidden, bias=cfg.attention_bias)
        self.pad = mla.latent_dim % 2  # rows are padded to an even width (LatentKVPool)

    def forward(self, x: torch.Tensor, rope: RopeBatch, backend, meta: AttentionMetadata,
                rows: OutputRows | None = None) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        if hasattr(self, "q_proj"):
            q = apply_linear(self.q_proj, x)
        else:
            q = apply_linear(self.q_b_proj, self.q_a_layernorm(apply_linear(self.q_a_proj, x)))
        q = q.view(t, h, self.nope + self.rope)
        latent = apply_linear(self.kv_a_proj_with_mqa, x)  # [T, r + dr]
        cos, sin = rope.per_token(x.dtype)  # [T, 1, dr]
        c_kv = self.kv_a_layernorm(latent[:, :self.rank])
        k_pe = rope_rotary_dims(latent[:, None, self.rank:], cos, sin, self.interleaved)  # [T, 1, dr]
        parts = [c_kv.unsqueeze(1), k_pe] + ([k_pe.new_zeros(t, 1, 1)] if self.pad else [])
        row = torch.cat(parts, dim=-1)  # [T, 1, row_width]
        q_lat = torch.stack([self.w_uk[i](q[:, i, :self.nope]) for i in range(h)], dim=1)  # [T, H, r]
        q_pe = rope_rotary_dims(q[..., self.nope:], cos, sin, self.interleaved)  # [T, H, dr]
        parts = [q_lat, q_pe] + ([q_pe.new_zeros(t, h, 1)] if self.pad else [])
        q_abs = torch.cat(parts, dim=-1)  # [T, H, row_width]
        out_lat = backend.forward_latent(q_abs, row, self.layer_id, meta, rows)  # [T', H, r]
        out = torch.cat([self.w_uv[i](out_lat[:, i]) for i in range(h)], dim=-1)  # [T', H * dv]
        return apply_linear(self.o_proj, out)


class GQAPartialRopeAttention(nn.Module):
    tp = None

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.q_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: RopeBatch, backend: AttentionBackend, meta: AttentionMetadata,
                rows: OutputRows | None = None) -> torch.Tensor:
        hq, hkv = self.num_heads, self.num_kv_heads
        qkv = apply_linear(self.qkv_proj, x).view(x.shape[0], -1, self.head_dim)  # [T, Hq + 2 Hkv, D]
        q, k, v = qkv.split([hq, hkv, hkv], dim=1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope.per_token(x.dtype)  # [T, 1, rope_dim]
        # one tensor again: the cpu kernel reads k and v rows with one stride
        qkv = torch.cat([rope_rotary_dims(q, cos, sin, False), rope_rotary_dims(k, cos, sin, False), v], dim=1)
        if rows is not None:
            backend.kv_pool.write(self.layer_id, qkv[:, hq:hq + hkv], v, meta.write_pages, meta.write_offsets)
            qkv, meta = qkv[rows.index], rows.meta  # k/v there: written again
        out = backend.forward(qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], self.layer_id, meta)  # [T, Hq, D]
        return apply_linear(self.o_proj, out.reshape(-1, self.q_size))

