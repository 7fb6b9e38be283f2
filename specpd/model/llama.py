"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral-style), Qwen2 (q/k/v bias) and Qwen3 (q/k norm).

Tokens of every sequence in a batch are flattened along dim 0; attention over the paged KV pool is
delegated to an AttentionBackend with per-batch AttentionMetadata passed explicitly.
q/k/v and gate/up projections are fused into one matmul each (fewer ops per layer on CPU).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specpd.attention.base import AttentionBackend
from specpd.attention.metadata import AttentionMetadata
from specpd.config import ModelConfig
from specpd.kernels import cpu_ops
from specpd.kernels.cpu_linear import PackedLinear, mkldnn_ok, pack_linears
from specpd.model.cpu_stack import Stack


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused(x):  # one C pass (specpd/kernels/cpu_ops.py)
            return cpu_ops.rms_norm(x, self.weight, self.eps)[0]
        # torch's own op: in fp32 bit-identical to HF's x * rsqrt(mean(x^2) + eps) * weight (the
        # HF-equivalence tests check it), fewer ops; in bf16/fp16 it rounds once where HF rounds twice.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm where the kernel runs."""
        if _fused(x):
            return cpu_ops.rms_norm(x, self.weight, self.eps, residual)
        summed = x + residual
        return self(summed), summed


def _fused(x: torch.Tensor) -> bool:
    """The C glue kernels run here: CPU, serving (no autograd: a draft trainer's norms keep torch's ops)."""
    return not torch.is_grad_enabled() and cpu_ops.usable(x)


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's RoPE variant."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling_dict
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


class Rotary(nn.Module):
    """Neox-style (rotate-half) RoPE with a precomputed cos/sin table indexed by position."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        inv_freq, attn_scale = rope_inv_freq(cfg)
        freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)  # [max_pos, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * attn_scale, persistent=False)  # [max_pos, D]
        # sin with the first half negated: rotate_half(x) * sin == swap_halves(x) * signed_sin exactly
        # (a sign flip does not round), one op fewer per layer
        half = inv_freq.shape[0]
        signed = torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], dim=-1)
        self.register_buffer("signed_sin", signed * attn_scale, persistent=False)  # [max_pos, D]

    def _apply(self, fn, recurse=True):
        """A dtype cast of the model leaves the tables fp32 (fused kernels read them as such; per-token
        copies are cast per step); a device move moves them."""
        tables = (self.cos, self.signed_sin)
        super()._apply(fn, recurse)
        if not tables[0].is_meta:  # (a model built on meta gets its tables rebuilt after loading)
            self.cos, self.signed_sin = (t.to(self.cos.device) for t in tables)
        return self

    def table(self, positions: torch.Tensor, dtype: torch.dtype | None = None) -> "RopeBatch":
        """The step's RoPE inputs (built once per forward, used by every layer)."""
        return RopeBatch(positions, self.cos, self.signed_sin)


@dataclass
class RopeBatch:
    """A step's positions and the fp32 RoPE tables. A backend with a fused kernel reads the tables at the
    positions itself (`attend`); the others take the per-token cos / signed sin (`per_token`)."""

    positions: torch.Tensor  # [T] int64
    cos: torch.Tensor  # [max_pos, D] fp32, attention scaling folded in
    signed_sin: torch.Tensor  # [max_pos, D] fp32, first half negated
    _per_token: dict | None = None

    def per_token(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [T, 1, D] in `dtype` (computed once per step and dtype)."""
        if self._per_token is None:
            self._per_token = {}
        got = self._per_token.get(dtype)
        if got is None:
            got = self._per_token[dtype] = (self.cos[self.positions].unsqueeze(1).to(dtype),
                                            self.signed_sin[self.positions].unsqueeze(1).to(dtype))
        return got


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Neox RoPE, x * cos + rotate_half(x) * sin. x [T, H, D] (q and k heads together), cos/signed_sin [T, 1, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


def apply_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """layer(x) (a PackedLinear, a quantized linear, or a plain nn.Linear the model kept)."""
    return layer(x)


def head_logits(x: torch.Tensor, head: nn.Module | None, target: "CausalLM | None") -> torch.Tensor:
    """A draft's logits [T, rows] fp32: its own head, or (head None) the target's (what
    F.linear(x, target.lm_head_weight) computes, through the target's packed copy when it has one)."""
    if head is not None:
        return head(x).float()
    return target.compute_logits(x)


@dataclass
class OutputRows:
    """The rows of a forward whose output is used, for a layer whose K/V is needed at every row but whose
    output only at some (a one-layer draft's extend: the next round reads only each item's last hidden).
    `meta`: one query row per index, planned by the caller, over the same sequences and KV lengths."""

    index: torch.Tensor  # [R] int64 rows of the step
    meta: AttentionMetadata


class Attention(nn.Module):
    tp = None  # a TPGroup (specpd/model/tp.py) when this is one rank's shard of the heads

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, rope: "RopeBatch", backend: AttentionBackend, meta: AttentionMetadata,
                rows: "OutputRows | None" = None):
        """rows: K/V of every row goes to the cache, the attention output only at rows.index (see OutputRows)."""
        qkv = apply_linear(self.qkv_proj, x).view(x.shape[0], -1, self.head_dim)  # [T, Hq + 2 * Hkv, D]
        q_heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.q_norm is not None:
            qkv = torch.cat([self.q_norm(qkv[:, :q_heads]), self.k_norm(qkv[:, q_heads:q_heads + kv_heads]),
                             qkv[:, q_heads + kv_heads:]], dim=1)
        attend = getattr(backend, "attend", None)
        if attend is not None:  # RoPE, the KV write and attention in the backend's kernel
            out = attend(qkv, rope, self.layer_id, meta, rows)
        else:
            q, k = apply_rope(qkv[:, :q_heads + kv_heads], *rope.per_token(qkv.dtype)).split([q_heads, kv_heads], dim=1)
            v = qkv[:, q_heads + kv_heads:]  # [T, Hkv, D]
            if rows is not None:
                backend.kv_pool.write(self.layer_id, k, v, meta.write_pages, meta.write_offsets)
                q, k, v, meta = q[rows.index], k[rows.index], v[rows.index], rows.meta  # k/v there: written again
            out = backend.forward(q, k, v, self.layer_id, meta)  # [T, Hq, D]
        out = apply_linear(self.o_proj, out.reshape(-1, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)  # row-parallel: partial sums (specpd/model/tp.py)


class MLP(nn.Module):
    tp = None  # a TPGroup when this is one rank's slice of the intermediate

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate_up = apply_linear(self.gate_up_proj, x)
        if _fused(gate_up):
            out = apply_linear(self.down_proj, cpu_ops.silu_mul(gate_up))
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            out = apply_linear(self.down_proj, F.silu(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, backend, meta, rows: "OutputRows | None" = None):
        """The layer's output x + attn + mlp. rows: the output only at rows.index (every row's K/V is still
        written)."""
        out, residual = self.forward_split(x, None, rope, backend, meta, rows)
        return out + residual

    def forward_split(self, h: torch.Tensor, residual: torch.Tensor | None, rope, backend, meta,
                      rows: "OutputRows | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over the input h + residual (residual None: h alone), returned unsummed as (mlp output,
        the residual stream after attention): the sum is fused into the next layer's input norm (vLLM's
        layout), so a residual add costs no pass of its own."""
        if residual is None:
            normed, residual = self.input_layernorm(h), h
        else:
            normed, residual = self.input_layernorm.add_norm(h, residual)
        attn = self.self_attn(normed, rope, backend, meta, rows)
        if rows is not None:
            residual = residual[rows.index]
        normed, residual = self.post_attention_layernorm.add_norm(attn, residual)
        return self.mlp(normed), residual


class CausalLM(nn.Module):
    """Decoder + LM head. `forward` returns final hidden states; `compute_logits` applies the head."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg, max_positions)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # a weight-only quantized copy of the head (specpd.model.quant), used by compute_logits when set
        self.quantized_head: nn.Module | None = None
        self.weight_formats: dict[str, int] = {}  # quantized weights per format ("dense": the others; quant.py)
        self.packed_head: PackedLinear | None = None  # the head prepacked for oneDNN (pack_for_cpu)
        self.cpu_stack = None  # the decoder layers as one C call (specpd/model/cpu_stack.py; pack_for_cpu)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata, capture_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids, positions [T] -> (normed hidden [T, H], captured hidden inputs of the
        requested layers [T, H] each, e.g. for EAGLE-3's fused aux hidden states)."""
        h = self.embed_tokens(input_ids)
        rope = self.rotary.table(positions, h.dtype)
        if self.cpu_stack is not None:  # the same kernels in one C call where it applies (else None)
            done = self.cpu_stack.run(h, rope, backend, meta, capture_layers)
            if done is not None:
                return done
        residual = None  # the stream is h + residual (DecoderLayer.forward_split)
        captured = []
        for i, layer in enumerate(self.layers):
            if i in capture_layers:  # the layer's input, summed (EAGLE-3's aux features)
                if residual is not None:
                    h, residual = h + residual, None
                captured.append(h)
            h, residual = layer.forward_split(h, residual, rope, backend, meta)
        return self.norm.add_norm(h, residual)[0], captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quantized_head is not None:
            return self.quantized_head(hidden).float()  # [rows, vocab]
        if self.packed_head is not None:
            return self.packed_head(hidden).float()
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.embed_tokens.weight).float()

    @torch.no_grad()
    def pack_for_cpu(self) -> None:
        """CPU serving: every remaining nn.Linear of the decoder -> PackedLinear (oneDNN, prepacked once), and
        a packed copy of the LM head (tied to the embedding: the embedding stays for the lookup). Call after
        load_weights / quantization / the dtype cast."""
        pack_linears(self)  # an untied lm_head included
        if self.quantized_head is None and self.lm_head is None and mkldnn_ok(self.embed_tokens.weight.dtype):
            self.packed_head = PackedLinear(self.embed_tokens.weight, None)
        self.cpu_stack = Stack.build(self)
        cpu_ops.available()  # built now, not in the first step (a failed build is logged and torch takes the glue)

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights (model.layers.N.self_attn.q_proj.weight, ...) into the fused layout."""
        cfg = self.config
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, tensor: torch.Tensor, rows: slice | None = None):
            target = params[name]
            dst = target if rows is None else target[rows]
            if dst.shape != tensor.shape:
                raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)} vs model {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(name)

        q, kv = cfg.q_size, cfg.kv_size
        fused = {"q_proj": ("qkv_proj", slice(0, q)), "k_proj": ("qkv_proj", slice(q, q + kv)),
                 "v_proj": ("qkv_proj", slice(q + kv, q + 2 * kv)),
                 "gate_proj": ("gate_up_proj", slice(0, cfg.intermediate_size)),
                 "up_proj": ("gate_up_proj", slice(cfg.intermediate_size, 2 * cfg.intermediate_size))}
        for name, tensor in weights.items():
            if "rotary_emb" in name:
                continue
            key = name.removeprefix("model.")
            if key == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            parts = key.split(".")
            if len(parts) >= 4 and parts[-2] in fused:
                target, rows = fused[parts[-2]]
                put(".".join(parts[:-2] + [target, parts[-1]]), tensor, rows)
            elif key in params:
                put(key, tensor)
            else:
                raise ValueError(f"unexpected weight {name!r} for {cfg.architecture}")
        # a fused param is complete only when all its pieces were loaded; check coverage by name
        missing = [n for n in params if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
