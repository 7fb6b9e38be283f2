"""RoPE of the MoE families: YaRN (DeepSeek-V3), rotary dims narrower than the head (MLA's qk_rope_head_dim,
GLM-4.5's partial_rotary_factor), interleaved pairs (DeepSeek), and MLA's softmax scale.

Tables are Rotary's (specpd/model/llama.py: fp32 cos and sign-folded sin, [max_pos, rope_dim], the YaRN attention
factor folded in), so a step's RopeBatch and `apply_rope` serve these layers too. The math is transformers'
(modeling_rope_utils._compute_yarn_parameters; DeepseekV3's yarn_get_mscale and apply_rotary_pos_emb_interleave).
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from specpd.config import ModelConfig
from specpd.model.llama import Rotary, apply_rope, rope_inv_freq


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, base: float, scaling: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2], attention factor) of YaRN over `dim` rotary dims."""
    factor = scaling.get("factor") or max_positions / scaling["original_max_position_embeddings"]
    attention = scaling.get("attention_factor")
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None:
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def family_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies over cfg.rope_dim and the attention factor folded into the tables."""
    scaling = cfg.rope_scaling_dict
    if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn":
        return yarn_inv_freq(cfg.rope_dim, cfg.rope_theta, scaling, cfg.max_position_embeddings)
    return rope_inv_freq(replace(cfg, head_dim=cfg.rope_dim))  # default, linear, llama3 over the rotary dims


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 where the config has one (DeepSeek-V3)."""
    scale = cfg.mla.qk_head_dim ** -0.5
    scaling = cfg.rope_scaling_dict
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        if scaling.get("mscale_all_dim"):
            mscale = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
            scale *= mscale * mscale
    return scale


class FamilyRotary(Rotary):
    """Rotary's tables over the config's rotary dims (cfg.rope_dim) with YaRN where the config says so."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        nn.Module.__init__(self)
        inv_freq, attn_scale = family_inv_freq(cfg)
        freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)  # [max_pos, rope_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        half = inv_freq.shape[0]
        self.register_buffer("cos", emb.cos() * attn_scale, persistent=False)  # [max_pos, rope_dim]
        signed = torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], dim=-1)
        self.register_buffer("signed_sin", signed * attn_scale, persistent=False)


def make_rotary(cfg: ModelConfig, max_positions: int) -> Rotary:
    """The decoder's RoPE tables: Rotary for the dense families, FamilyRotary for the MoE ones."""
    return Rotary(cfg, max_positions) if cfg.moe is None else FamilyRotary(cfg, max_positions)


def rope_rotary_dims(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE over x's leading cos.shape[-1] dims, the rest passed through; x [T, H, D], cos / signed_sin [T, 1, R].
    interleaved: the rotary dims come in (x0, x1) pairs; they leave de-interleaved ([x0, x2, ..., x1, x3, ...]
    rotated), which is HF's interleaved formula term for term (and what its cache holds)."""
    rot = cos.shape[-1]
    part = x if rot == x.shape[-1] else x[..., :rot]
    if interleaved:
        part = torch.cat([part[..., 0::2], part[..., 1::2]], dim=-1)
    out = apply_rope(part, cos, signed_sin)
    return out if rot == x.shape[-1] else torch.cat([out, x[..., rot:]], dim=-1)
