"""Weight-only quantization for the CPU decode path: int4 (groups of 32) and int8 (per channel).

Decode at small batch streams every weight once per step, so it is bound by memory, not FLOPs;
4-bit weights move 1/8 of the fp32 bytes. Activations stay bfloat16: torch's CPU kernels below are
vectorized only for bf16 (with fp32 activations they run a scalar loop, ~10x slower than a dense
fp32 matmul), so `quantization != "none"` requires `dtype="bfloat16"` and `device="cpu"`.

int4, `aten._weight_int4pack_mm_for_cpu(x, packed, 32, scale_zeros)`:
  w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g],  g = k // 32,  q in 0..15.
  Each group of 32 consecutive input columns of one output row is quantized asymmetrically:
  scale = (max - min) / 15, zero = min + 8 * scale, q = round((w - min) / scale).
int8, `aten._weight_int8pack_mm(x, q, scale)`: w[n, k] = q[n, k] * scale[n], scale = absmax(row) / 127.

GGUF Q4_1 (the default model's layers) is the same int4 grid: a block is 32 consecutive weights of
one row along the input dim, stored as fp16 d, fp16 m and codes 0..15 with w = d * q + m; that is
scale = d, zero = m + 8 * d. llama.cpp's Q4_1 quantizer puts each block's min at code 0 and its max
at code 15, so min/max of the dequantized block give back d, m and every code exactly (true of all
3.3M layer blocks of the default model; tests/model/test_quant.py re-checks three layers). Fusing
does not break blocks: the loader's q/k un-permutation moves whole rows, and qkv_proj / gate_up_proj
stack the q, k, v (gate, up) rows, so every fused row is one GGUF row and its groups are that row's
blocks.
What the kernel cannot keep: scale and zero are stored in the activation dtype, bf16 (8-bit
mantissa) instead of Q4_1's fp16 d, m, which moves a weight by at most ~2^-9 of its block's range;
a matmul's error is then about that of the dense bf16 engine, which rounds every weight to bf16.

The LM head is int8 in both modes. The default GGUF stores it (the tied embedding) as Q8_0, and
re-quantizing it to 4 bits is the one lossy step that shows: greedy output of SmolLM2 drifted from
dense bf16 after 3-8 tokens with an int4 head, after 8-32 (like bf16 vs fp32) with int8, at about
the same decode speed. The embedding lookup keeps the full-precision table.

Prefill chunks (>= DENSE_ROWS rows) do not use the kernels, which are 2x slower than a dense fp32
GEMM at 512 rows on one core: they dequantize the same weight values to fp32 per call and use
F.linear. So int4 keeps its codes twice (the kernel's blocked packing and plain nibbles), about
1 byte per weight plus scales: half of bf16, not a quarter; int8 keeps 1 byte per weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specpd.config import EngineConfig

QUANT_METHODS = ("none", "int4", "int8")
HEAD_METHOD = "int8"  # the LM head's format whatever the method (see the module docstring)
INT4_GROUP = 32
INT4_ROWS = 16  # the CPU int4 packing needs out_features % 16 == 0
DENSE_ROWS = 128  # inputs with this many rows take the dequantize + fp32 GEMM path (QuantLinear)


def check_config(config: EngineConfig) -> None:
    if config.quantization not in QUANT_METHODS:
        raise ValueError(f"quantization must be one of {QUANT_METHODS}, got {config.quantization!r}")
    if config.quantization == "none":
        return
    if config.dtype != "bfloat16":
        raise ValueError(f"quantization={config.quantization!r} needs dtype='bfloat16', got dtype={config.dtype!r}: "
                         "torch's CPU int4/int8 weight-only kernels are only fast with bf16 activations")
    if torch.device(config.device).type != "cpu":
        raise ValueError(f"quantization={config.quantization!r} is implemented for device='cpu' only, "
                         f"got device={config.device!r}")


# -- int4 ----------------------------------------------------------------------------------------
def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes [N, K] uint8 in 0..15, scale [N, K // group], low [N, K // group]),
    all in fp32 math, with weight ~= codes * scale + low (exact for Q4_1-dequantized weights)."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"int4 needs in_features divisible by {group}, got {k}")
    w = weight.detach().float().view(n, k // group, group)
    low, high = w.amin(-1), w.amax(-1)  # [N, G]
    scale = (high - low) / 15
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))  # a constant group: every code 0
    codes = ((w - low.unsqueeze(-1)) * inv.unsqueeze(-1)).round_().clamp_(0, 15)
    return codes.to(torch.uint8).view(n, k), scale, low


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The pure-torch reference of what quantize_int4 stores: [N, K] fp32."""
    n, k = codes.shape
    groups = codes.view(n, scale.shape[1], -1).float()
    return (groups * scale.unsqueeze(-1) + low.unsqueeze(-1)).view(n, k)


class QuantLinear(nn.Module):
    """A bias-optional linear layer over quantized weights. Rows of x up to DENSE_ROWS (decode,
    verify, small chunks) go through torch's weight-only kernel; longer inputs (prefill chunks)
    dequantize the weights to fp32 once per call and use the dense fp32 GEMM, which beats the int4/int8
    kernels there (2x slower than fp32 at 512 rows on one core) while the dequantization costs little
    next to the GEMM. Both paths use the same weight values."""

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None, act_dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("bias", None if bias is None else bias.detach().to(act_dtype).clone())

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] contiguous, the activation dtype -> [M, N]."""
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        """The weights the kernel multiplies by, [N, K] fp32."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).contiguous()  # [M, K]
        if x2.shape[0] >= DENSE_ROWS:
            y = F.linear(x2.float(), self.dequantized()).to(x.dtype)
        else:
            y = self.kernel(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Int4Linear(QuantLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype = torch.bfloat16):
        super().__init__(*weight.shape, bias, act_dtype)
        if self.out_features % INT4_ROWS:
            raise ValueError(f"int4 needs out_features divisible by {INT4_ROWS}, got {self.out_features}")
        codes, scale, low = quantize_int4(weight)
        # the kernel's zero is the value of code 8: w = (q - 8) * scale + zero
        scale_zeros = torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1)  # [G, N, 2]
        self.register_buffer("scale_zeros", scale_zeros.to(act_dtype).contiguous())
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1))
        # the same codes two per byte (low nibble: even k) for the dense path: the kernel's packing is
        # an internal, blocked layout
        self.register_buffer("nibbles", codes[:, 0::2] | (codes[:, 1::2] << 4))  # [N, K / 2] uint8

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scale_zeros)

    def dequantized(self) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        w = torch.empty(n, k // 2, 2)  # unpacked straight into fp32 and scaled in place: 3x faster than stack()
        w[..., 0], w[..., 1] = self.nibbles & 15, self.nibbles >> 4
        scale, zero = self.scale_zeros.float().transpose(0, 1).unbind(-1)  # [N, G] each
        low = (zero - 8 * scale).unsqueeze(-1)  # the value of code 0
        return w.view(n, k // INT4_GROUP, INT4_GROUP).mul_(scale.unsqueeze(-1)).add_(low).view(n, k)


# -- int8 ----------------------------------------------------------------------------------------
def int8_scale(weight: torch.Tensor) -> torch.Tensor:
    """Each output row's int8 scale [N] fp32: its absmax over every input column / 127."""
    return weight.detach().float().abs().amax(-1) / 127


def quantize_int8(weight: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes [N, K] int8 in -127..127, scale [N] fp32), weight ~= codes * scale[:, None].
    `scale`: the rows' scales when they were taken over more columns than `weight` holds (a tensor-parallel
    shard of a row-parallel layer, specpd/model/tp.py), so its codes are the whole row's."""
    w = weight.detach().float()
    scale = int8_scale(w) if scale is None else scale
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (w * inv.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8), scale


class Int8Linear(QuantLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype = torch.bfloat16,
                 scale: torch.Tensor | None = None):
        super().__init__(*weight.shape, bias, act_dtype)
        codes, scale = quantize_int8(weight, scale)
        self.register_buffer("codes", codes)  # [N, K] int8
        self.register_buffer("scale", scale.to(act_dtype))  # [N]

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.codes, self.scale)

    def dequantized(self) -> torch.Tensor:
        return self.codes.float() * self.scale.float().unsqueeze(1)


_LINEARS = {"int4": Int4Linear, "int8": Int8Linear}


def quantize_linear(method: str, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    scale: torch.Tensor | None = None) -> QuantLinear:
    """`scale`: int8 only, the rows' scales taken over the whole row (quantize_int8)."""
    if scale is None:
        return _LINEARS[method](weight, bias)
    if method != "int8":
        raise ValueError(f"a given row scale is int8's, not {method!r}'s")
    return Int8Linear(weight, bias, scale=scale)


@torch.no_grad()
def quantize_model(model: nn.Module, method: str, row_scales: list[dict[str, torch.Tensor]] | None = None) -> None:
    """Swap the decoder's projections for quantized ones and give the model an int8 LM head.

    Done once at load time, before the first forward. The full-precision head weight stays in place
    (`lm_head_weight`: the embedding when tied) for drafts that borrow it; only the target's own
    `compute_logits` uses the quantized copy. `row_scales[i]`: int8 scales of layer i's "o_proj" / "down_proj"
    taken over their whole rows, for a tensor-parallel shard that holds some of the columns."""
    if method == "none":
        return
    for i, layer in enumerate(model.layers):
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            linear: nn.Linear = getattr(parent, name)
            scale = row_scales[i].get(name) if row_scales else None
            setattr(parent, name, quantize_linear(method, linear.weight, linear.bias, scale))
    model.quantized_head = quantize_linear(HEAD_METHOD, model.lm_head_weight)
