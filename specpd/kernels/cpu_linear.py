"""Linear layers for CPU serving: weights prepacked once at load for oneDNN (torch's mkldnn ops).

bf16 (AMX / AVX512-BF16): `mkldnn._linear_pointwise` on a weight reordered once into oneDNN's blocked layout.
On an AMX box the tiles make 1..64 rows cost about what reading the weight costs (evals/bench_gemm.py), which
is what speculative verify and batched decode need. fp32: one row (decode at batch 1) streams the [in, out]
copy through MKL's gemv, which reads it fastest; two rows and more take oneDNN's packed fp32 GEMM (MKL's sgemm
packs the weight on every call at few rows). The choice per dtype and row count is measured
(evals/bench_gemm.py → evals/results/gemm.json), not assumed.

`PackedLinear` replaces an nn.Linear in place (`pack_linears`); its reference is F.linear over the original
weight (tests/model/test_cpu_linear.py, ragged row counts, bias, both dtypes). Inference only: no autograd.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

GEMV_FP32_MAX_ROWS = 1  # fp32 rows up to this many stream the [in, out] copy (MKL gemv); more: oneDNN packed
PACK_ROWS_HINT = 16  # oneDNN picks the blocked layout for this many rows; measured flat from 1 to 64 rows


@functools.cache
def mkldnn_ok(dtype: torch.dtype) -> bool:
    """oneDNN's prepacked linear runs here for `dtype` (bf16 also needs the CPU's native bf16)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W prepacked for oneDNN (and, fp32, an [in, out] copy for one-row gemv)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)
        # fp32 one-row decode: MKL's gemv over [in, out] (decode at batch 1 is most of a chat's steps)
        self.weight_t = weight.t().contiguous() if weight.dtype == torch.float32 else None
        self.bias = None if bias is None else bias.detach().clone()

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PackedLinear":
        return cls(linear.weight, linear.bias)

    @property
    def weight(self) -> torch.Tensor:
        """The [out, in] weight (fp32: a view of the gemv copy; bf16: unpacked on demand, serving never asks)."""
        if self.weight_t is not None:
            return self.weight_t.t()
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if x.dim() != 2:
            x = x.reshape(-1, shape[-1])
        if self.weight_t is not None and x.shape[0] <= GEMV_FP32_MAX_ROWS:
            out = x @ self.weight_t
            if self.bias is not None:
                out = out + self.bias
        else:
            out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return out if len(shape) == 2 else out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, dtype={self.dtype}, bias={self.bias is not None}"


def can_pack(linear: nn.Module) -> bool:
    w = getattr(linear, "weight", None)
    return (type(linear) is nn.Linear and w is not None and w.device.type == "cpu" and mkldnn_ok(w.dtype))


@torch.no_grad()
def pack_linears(module: nn.Module) -> int:
    """Every plain nn.Linear under `module` (itself excluded) -> PackedLinear, where oneDNN runs its dtype.
    Returns how many were packed."""
    n = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if can_pack(child):
                setattr(parent, name, PackedLinear.from_linear(child))
                n += 1
    return n


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for callers holding a bare weight (tests' reference)."""
    return F.linear(x, weight, bias)
