"""The fp32 GEMM (csrc/cpu_gemm_f32.c) on CPUs with AVX-512: cpu_gemm_bf16's layout and tiles for fp32 weights
([N/16][K][16], one FMA per vector and row), so a decode row streams each fp32 weight once at close to the box's
memory bandwidth, where oneDNN's fp32 path reads it at about half of it (evals/kernels_gemm.py ->
evals/results/kernels_gemm.json). Every output element is the same chain of FMAs over K whatever the row count, tile
or thread split: batch invariant by construction, so it takes every fp32 GEMM (any width) and fp32 stays exact
between decode, verify and prefill rows. `gemm_ref` is its torch reference (tests/kernels/test_cpu_gemm_f32.py).

Off without AVX-512 (AVX2 boxes keep oneDNN), without a C compiler, with SPECPD_C_KERNELS=0 or with
SPECPD_GEMM_KERNEL=0 (oneDNN then takes every fp32 GEMM, as before the kernel)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specpd.kernels.cpu_gemm_bf16 import ANY_WIDTH, load_gemm, run_gemm


@functools.cache
def _lib():
    return load_gemm("f32", ("amx", "avx512_bf16", "avx512"))


def available() -> bool:
    return _lib() is not None


def max_rows() -> int:
    """Every width: the kernel is the only fp32 path where it runs (batch invariance, module docstring)."""
    return ANY_WIDTH


def usable(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 -> the kernel's layout, [ceil(N / 16), K, 16] fp32 (zero columns past N)."""
    weight = weight.detach().contiguous()
    n, k = weight.shape
    packed = weight.new_empty((n + 15) // 16, k, 16)
    _lib().specpd_gemm_f32_pack(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack's inverse: the [n, K] weight."""
    blocks, k = packed.shape[:2]
    return packed.permute(0, 2, 1).reshape(blocks * 16, k)[:n].contiguous()


def gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x [M, K] fp32 @ W.T (+ bias, fp32 [n]) -> [M, n] fp32; `packed` from pack(W)."""
    return run_gemm(_lib().specpd_gemm_f32, x, packed, bias, n)


def gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes up to fp32 rounding order, in torch: the products summed in float64."""
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()
