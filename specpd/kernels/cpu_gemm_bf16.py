"""The few-row bf16 GEMM (csrc/cpu_gemm_bf16.c) on CPUs with AVX512-BF16: decode and verify rows stream each
weight once from a layout packed at load, at close to the box's memory bandwidth, where oneDNN's bf16 path
reads it at ~0.6 of it for 1..16 rows (evals/kernels_gemm.py -> evals/results/kernels_gemm.json). Every output element
is the same fp32 chain of dot products over K whatever the row count, tile or thread split: batch invariant
by construction. `gemm_ref` is its torch reference (tests/kernels/test_cpu_gemm_bf16.py: ragged row counts,
widths that are not a multiple of 16, bias, invariance).

Off where the CPU lacks AVX512-BF16, without a C compiler, with SPECPD_C_KERNELS=0, or with
SPECPD_GEMM_KERNEL=0 (oneDNN then takes every row count, as before the kernel; benchmarks A/B it that way)."""
from __future__ import annotations

import ctypes
import functools
import os

import torch
import torch.nn.functional as F

from specpd.kernels.build import INT64 as _I
from specpd.kernels.build import VOID_P as _P
from specpd.kernels.build import load
from specpd.machine import isa


def load_gemm(name: str, isas: tuple[str, ...]):
    """csrc/cpu_gemm_<name>.c built for this CPU with its pack and GEMM entry points typed, or None where it is
    off (module docstring; cpu_gemm_f32 shares this)."""
    if os.environ.get("SPECPD_GEMM_KERNEL", "1") == "0" or isa() not in isas:
        return None
    lib = load(f"cpu_gemm_{name}.c")
    if lib is None or not getattr(lib, f"specpd_gemm_{name}_available")():
        return None
    typed = ((f"specpd_gemm_{name}_pack", [_P, _I, _I, _P]), (f"specpd_gemm_{name}", [_P, _I, _I, _P, _P, _I, _P]))
    for fn, args in typed:
        getattr(lib, fn).argtypes = args
        getattr(lib, fn).restype = ctypes.c_int
    return lib


def run_gemm(fn, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias, fp32 [n]) -> [M, n] in x's dtype through a kernel entry point `fn`."""
    x = x.contiguous()
    m, k = x.shape
    out = x.new_empty(m, n)
    rc = fn(x.data_ptr(), m, k, packed.data_ptr(), None if bias is None else bias.data_ptr(), n, out.data_ptr())
    if rc:
        raise ValueError(f"{fn.__name__}: kernel error {rc} (M={m}, K={k}, N={n})")
    return out


@functools.cache
def _lib():
    return load_gemm("bf16", ("amx", "avx512_bf16"))


def available() -> bool:
    return _lib() is not None


ANY_WIDTH = 1 << 62


def max_rows() -> int:
    """The widest GEMM the kernel takes (wider ones go to oneDNN). Without AMX it keeps up with or beats
    oneDNN's AVX512-BF16 path from 1 to 512 rows, and on AMX its tile path streams the weight for 1..16 rows at
    the cost of one and stays level with oneDNN above (evals/results/kernels_gemm.json): every GEMM (ANY_WIDTH), so bf16
    is batch invariant at any width, prefill chunks beside decode
    rows included. On AMX with the tile path off (SPECPD_GEMM_AMX=0, or Linux refused the tile state) its
    vdpbf16ps cost grows with the rows while oneDNN's tiles compute 17..32 rows for what 16 cost: 16 there."""
    return 16 if isa() == "amx" and not _lib().amx else ANY_WIDTH


def usable(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> the kernel's layout, [ceil(N / 16), K / 2, 16, 2] bf16 (zero columns past N)."""
    weight = weight.detach().contiguous()
    n, k = weight.shape
    packed = weight.new_empty((n + 15) // 16, k // 2, 16, 2)
    if _lib().specpd_gemm_bf16_pack(weight.data_ptr(), n, k, packed.data_ptr()):
        raise ValueError(f"gemm_bf16 pack: K = {k} is odd")
    return packed


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack's inverse: the [n, K] weight."""
    blocks, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(blocks * 16, pairs * 2)[:n].contiguous()


def gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x [M, K] bf16 @ W.T (+ bias, fp32 [n]) -> [M, n] bf16; `packed` from pack(W)."""
    return run_gemm(_lib().specpd_gemm_bf16, x, packed, bias, n)


def gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in torch: fp32 sums of bf16 products, bias in fp32, one rounding to bf16."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
