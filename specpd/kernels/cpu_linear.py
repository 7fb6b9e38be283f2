"""Linear layers for CPU serving: weights prepacked once at load for oneDNN (torch's mkldnn ops).

`mkldnn._linear_pointwise` on a weight reordered once into oneDNN's blocked layout, bf16 (AMX / AVX512-BF16)
and fp32 alike. On an AMX box a few bf16 rows cost what reading the weight costs (evals/results/kernels_gemm.json),
which is what speculative verify and batched decode need.

Batch invariance: a row's result must not depend on how many rows share its GEMM, or a verify row (or a
decode row beside other requests) could round differently from the same row decoded alone and greedy
speculation would stop being bit-identical to plain decoding. oneDNN's packed fp32 GEMM gives every row the
same result for any M >= 2, and its one-row path (a gemv) sums in another order: one row is therefore run as
two (the second a zero row). bf16 is invariant up to 32 rows (a wider batch takes another kernel: a batch
of more than 32 rows in bf16 rounds differently; fp32 stays exact at any width;
tests/model/test_cpu_linear.py checks both). MKL's fp32 gemv over an [in, out] copy streams one row faster,
but is not invariant: it is not used.

bf16 on an AVX512-BF16 / AMX CPU: the project's own kernel (cpu_gemm_bf16) streams the weight at the box's
read bandwidth where oneDNN's bf16 path reaches about half of it, and keeps up to 512 rows
(evals/results/kernels_gemm.json). It takes every bf16 GEMM (and oneDNN's copy of the weight is not made), on AMX tiles
where the CPU has them; only with its AMX
path off (SPECPD_GEMM_AMX=0) does an AMX CPU hand GEMMs wider than 16 rows to oneDNN. It is batch invariant by
construction, so bf16 is invariant at any width.
fp32 on an AVX-512 CPU: its fp32 sibling (cpu_gemm_f32, the same layout and tiles with FMAs) takes every fp32
GEMM, any width, so fp32 stays invariant (it streams the weight where oneDNN's few-row fp32 path does not, and
is level with it on a prefill chunk); oneDNN keeps fp32 on AVX2 boxes.

`PackedLinear` replaces an nn.Linear in place (`pack_linears`); its reference is F.linear over the original
weight (tests/model/test_cpu_linear.py, ragged row counts, bias, both dtypes). Under autograd it runs
F.linear over the unpacked weight, so a draft trainer can backpropagate through a packed target's head.

`QuantLinear` holds a weight in GGUF blocks (Q4_0 / Q4_1 / Q8_0) for the quantized kernel (cpu_gemm_q: AVX2 and
AVX512-VNNI, fp32 or bf16 activations, every width, batch invariant); specpd/model/quant.py decides which
linears take it (tests/model/test_quant.py, tests/kernels/test_cpu_gemm_q.py).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from specpd.kernels import cpu_gemm_bf16, cpu_gemm_f32, cpu_gemm_q
from specpd.machine import collapse_huge_pages

_KERNELS = {torch.bfloat16: cpu_gemm_bf16, torch.float32: cpu_gemm_f32}  # the project's GEMM per weight dtype
PACK_ROWS_HINT = 16  # oneDNN picks the blocked layout for this many rows (bf16 rows 1..32 one kernel with it)


@functools.cache
def mkldnn_ok(dtype: torch.dtype) -> bool:
    """oneDNN's prepacked linear runs here for `dtype` (bf16 also needs the CPU's native bf16)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W packed once at load: for the few-row bf16 kernel where it runs, for oneDNN where
    GEMMs wider than the kernel takes remain (one row runs as two: batch invariance, module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.bias = None if bias is None else bias.detach().clone()
        self.few_rows = 0  # GEMMs of up to this many rows go to the project's kernel (0: none)
        self.few_packed = self.few_bias = self.packed = None
        kernel = _KERNELS.get(self.dtype)
        if kernel is not None and kernel.usable(weight):
            self.few_rows = kernel.max_rows()
            self.few_packed = kernel.pack(weight)
            self.few_bias = None if bias is None else self.bias.float().contiguous()
        if self.few_rows < cpu_gemm_bf16.ANY_WIDTH:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)

    @property
    def kernel(self):
        """The project's GEMM module for this weight's dtype (cpu_gemm_bf16 / cpu_gemm_f32)."""
        return _KERNELS[self.dtype]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PackedLinear":
        return cls(linear.weight, linear.bias)

    @property
    def weight(self) -> torch.Tensor:
        """The [out, in] weight, unpacked on demand (serving never asks)."""
        if self.packed is None:
            return self.kernel.unpack(self.few_packed, self.out_features)
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if x.dim() != 2:
            x = x.reshape(-1, shape[-1])
        if torch.is_grad_enabled() and x.requires_grad:  # a trainer backpropagating through a frozen packed layer
            out = F.linear(x, self.weight, self.bias)
        elif x.shape[0] <= self.few_rows and x.dtype == self.dtype:
            out = self.kernel.gemm(x, self.few_packed, self.few_bias, self.out_features)
        elif self.packed is None:  # not the weight's dtype: no serving path sends one
            out = F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        elif x.shape[0] == 1:  # as two rows: the M >= 2 kernel's rounding (module docstring)
            out = torch.ops.mkldnn._linear_pointwise(torch.cat([x, torch.zeros_like(x)]), self.packed, self.bias,
                                                     "none", [], "")[:1]
        else:
            out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return out if len(shape) == 2 else out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, dtype={self.dtype}, bias={self.bias is not None}, "
                f"few_rows={self.few_rows}")


class QuantLinear(nn.Module):
    """y = x @ W.T + b with W in GGUF blocks (Q4_0 / Q4_1 / Q8_0: specpd/model/quant.py decides which linears),
    packed once for the quantized kernel (specpd/kernels/cpu_gemm_q.py): fp32 or bf16 activations, any row count,
    batch invariant. Its reference is F.linear over the dequantized weight with the activation quantized per
    32-block (cpu_gemm_q.gemm_ref). Where the kernel does not run (no C compiler, a CPU without AVX2) and under
    autograd it computes F.linear over the dequantized fp32 weight (kept once, for the former)."""

    def __init__(self, fmt: str, blocks: torch.Tensor, in_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.fmt, self.in_features, self.out_features = fmt, in_features, blocks.shape[0]
        # plain attributes, not buffers: a dtype cast of the model leaves the codes and the fp32 bias alone
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.packed = self.dense = None
        if cpu_gemm_q.usable(fmt, in_features):
            self.packed = cpu_gemm_q.pack(fmt, blocks, in_features)  # uint8, the file's bytes regrouped
        else:
            self.dense = cpu_gemm_q.dequantize(fmt, blocks, in_features)

    def dequantized(self) -> torch.Tensor:
        """The [out, in] fp32 weight the blocks hold."""
        if self.dense is not None:
            return self.dense
        blocks = cpu_gemm_q.unpack(self.fmt, self.packed, self.out_features, self.in_features)
        return cpu_gemm_q.dequantize(self.fmt, blocks, self.in_features)

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantized()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.packed is None or (torch.is_grad_enabled() and x.requires_grad):
            out = F.linear(x2.float(), self.dequantized(), self.bias).to(x.dtype)
        else:
            out = cpu_gemm_q.gemm(x2, self.fmt, self.packed, self.bias, self.out_features)
        return out if len(shape) == 2 else out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.fmt}, bias={self.bias is not None}"


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


def weights_on_huge_pages(module: nn.Module) -> int:
    """Move the memory under `module`'s CPU tensors (parameters, buffers, prepacked weights) onto transparent huge
    pages (specpd.machine.collapse_huge_pages), once they are final. Every step streams them whole, and on 4 KB
    pages that is a TLB miss per 4 KB, which a b1 decode step pays (engine_step.json). Returns the bytes
    collapsed (0 where the kernel has no MADV_COLLAPSE)."""
    spans, seen = [], set()
    for m in module.modules():
        tensors = [*m._parameters.values(), *m._buffers.values(),
                   *(v for v in vars(m).values() if isinstance(v, torch.Tensor))]
        for t in tensors:
            if t is None or t.device.type != "cpu" or t.numel() == 0 or t.is_mkldnn or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    return collapse_huge_pages(spans)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for callers holding a bare weight (tests' reference)."""
    return F.linear(x, weight, bias)
