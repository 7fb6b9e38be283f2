"""The quantized-weight GEMM (csrc/cpu_gemm_q.c): y = x @ W.T with W in GGUF's 32-weight blocks (Q4_0, Q4_1,
Q8_0) as the file holds them, x and y fp32 or bf16, on AVX2 and AVX512-VNNI CPUs. Decode and verify rows stream
the blocks (4.5 to 8.5 bits a weight) instead of fp32 / bf16 weights, dequantized in registers; one block's codes
serve every row of a step.

What it computes (`gemm_ref` is the torch reference; csrc/cpu_gemm_q.c's header has the kernel's order):
  - each row of x quantized per 32-block: amax = max |x|, dx = amax / 127, codes q = round_half_even(x * 127 /
    amax) in [-127, 127] (`quantize_rows_ref`), llama.cpp's activation quantization with an fp32 scale;
  - y = sum over blocks of dx * dw * sum(q * q_w) (+ dx * sum(q) * m for Q4_1): exactly the dequantized weight
    times the dequantized activation, summed in fp32 in K order (the reference sums in float64), + bias, one
    rounding to x's dtype.
Against F.linear over the dequantized weight and the unquantized x the difference is the activation's rounding:
at most half a step (dx / 2) per input, so |y - F.linear(x, W)| <= F.linear(dx / 2, |W|) (tests/kernels/
test_cpu_gemm_q.py checks that bound).

Batch invariant by construction (a row's result never depends on M, the tile or the thread split) and
ISA invariant: the AVX2 build computes the same bits as the AVX512-VNNI one.

Off where the CPU lacks AVX2 + FMA + F16C, without a C compiler, with SPECPD_C_KERNELS=0, or with
SPECPD_GEMM_KERNEL=0: `available()` is False and callers keep dequantized dense weights."""
from __future__ import annotations

import ctypes
import functools
import os

import numpy as np
import torch
import torch.nn.functional as F

from specpd.kernels.build import DTYPE_CODES
from specpd.kernels.build import INT64 as _I
from specpd.kernels.build import VOID_P as _P
from specpd.kernels.build import load

BLOCK = 32  # weights per block along K
# ggml's type ids (GGMLQuantizationType) of the formats the kernel takes, and their block sizes in bytes
FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
PATHS = {2: "avx512_vnni", 1: "avx2"}  # specpd_gemm_q_available's codes


@functools.cache
def _lib():
    if os.environ.get("SPECPD_GEMM_KERNEL", "1") == "0":
        return None
    return _typed(load("cpu_gemm_q.c"))


def variant(march: str):
    """The kernel built for another target (SPECPD_KERNEL_MARCH's values: x86-64-v3 is the AVX2 path), for
    benchmarks to time beside this CPU's build (the packed layout is the same), or None where it is not built."""
    saved = os.environ.get("SPECPD_KERNEL_MARCH")
    os.environ["SPECPD_KERNEL_MARCH"] = march
    try:
        return _typed(load.__wrapped__("cpu_gemm_q.c"))
    finally:
        if saved is None:
            del os.environ["SPECPD_KERNEL_MARCH"]
        else:
            os.environ["SPECPD_KERNEL_MARCH"] = saved


def _typed(lib):
    if lib is None or not lib.specpd_gemm_q_available():
        return None
    lib.specpd_gemm_q_packed_bytes.argtypes = [ctypes.c_int, _I, _I]
    lib.specpd_gemm_q_packed_bytes.restype = _I
    for fn in (lib.specpd_gemm_q_pack, lib.specpd_gemm_q_unpack):
        fn.argtypes = [ctypes.c_int, _P, _I, _I, _P]
        fn.restype = ctypes.c_int
    lib.specpd_gemm_q.argtypes = [ctypes.c_int, ctypes.c_int, _P, _I, _I, _I, _P, _P, _I, _P]
    lib.specpd_gemm_q.restype = ctypes.c_int
    return lib


def available() -> bool:
    return _lib() is not None


def path() -> str | None:
    """The instruction path this build uses ('avx512_vnni' / 'avx2'), None where the kernel is off."""
    return PATHS[_lib().specpd_gemm_q_available()] if available() else None


def usable(fmt: str, k: int) -> bool:
    """The kernel takes a weight of `fmt` with `k` inputs here."""
    return fmt in FORMATS and k > 0 and k % BLOCK == 0 and available()


def pack(fmt: str, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """GGUF blocks [N, K / 32 * block bytes] uint8 (a tensor's rows as the file stores them) -> the kernel's
    layout (csrc/cpu_gemm_q.c's header), uint8, the same bytes rounded up to 16 columns."""
    blocks = blocks.detach().contiguous()
    n = blocks.shape[0]
    _check_blocks(fmt, blocks, n, k)
    size = _lib().specpd_gemm_q_packed_bytes(FORMATS[fmt], n, k)
    packed = torch.empty(size, dtype=torch.uint8)
    if _lib().specpd_gemm_q_pack(FORMATS[fmt], blocks.data_ptr(), n, k, packed.data_ptr()):
        raise ValueError(f"gemm_q pack: {fmt} [{n}, {k}] rejected")
    return packed


def unpack(fmt: str, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack's inverse: the [n, K / 32 * block bytes] GGUF blocks."""
    blocks = torch.empty(n, k // BLOCK * BLOCK_BYTES[fmt], dtype=torch.uint8)
    if _lib().specpd_gemm_q_unpack(FORMATS[fmt], packed.data_ptr(), n, k, blocks.data_ptr()):
        raise ValueError(f"gemm_q unpack: {fmt} [{n}, {k}] rejected")
    return blocks


def gemm(x: torch.Tensor, fmt: str, packed: torch.Tensor, bias: torch.Tensor | None, n: int, lib=None
         ) -> torch.Tensor:
    """x [M, K] fp32 / bf16 (rows may be strided) @ W.T (+ bias, fp32 [n]) -> [M, n] in x's dtype (another
    dtype is computed from fp32 and rounded back). lib: a `variant` (default: this CPU's build)."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        return gemm(x.float(), fmt, packed, bias, n, lib).to(x.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    out = x.new_empty(m, n)
    rc = (lib or _lib()).specpd_gemm_q(FORMATS[fmt], DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0) if m > 1 else k, m, k,
                              packed.data_ptr(), None if bias is None else bias.data_ptr(), n, out.data_ptr())
    if rc:
        raise ValueError(f"gemm_q: kernel error {rc} ({fmt}, M={m}, K={k}, N={n})")
    return out


def _check_blocks(fmt: str, blocks: torch.Tensor, n: int, k: int) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"gemm_q takes {sorted(FORMATS)}, not {fmt!r}")
    if k % BLOCK or blocks.dtype != torch.uint8 or tuple(blocks.shape) != (n, k // BLOCK * BLOCK_BYTES[fmt]):
        raise ValueError(f"{fmt} blocks of a [{n}, {k}] weight are uint8 [{n}, {k // BLOCK * BLOCK_BYTES[fmt]}] "
                         f"with K a multiple of {BLOCK}; got {blocks.dtype} {list(blocks.shape)}")


# -- blocks <-> dense (torch; the references) ------------------------------------------------------------------
def _fields(fmt: str, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(d [N, B] fp32, m [N, B] fp32 or None, codes [N, B, 32] int: Q8_0 signed, Q4 0..15 in element order)."""
    n = blocks.shape[0]
    b = blocks.view(n, -1, BLOCK_BYTES[fmt])
    d = b[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
    if fmt == "Q8_0":
        return d, None, b[..., 2:].contiguous().view(torch.int8).int()
    m = b[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1) if fmt == "Q4_1" else None
    qs = b[..., 4 if fmt == "Q4_1" else 2:].int()  # [N, B, 16]: element j low nibble, j + 16 high
    return d, m, torch.cat([qs & 15, qs >> 4], dim=-1)


def dequantize(fmt: str, blocks: torch.Tensor, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GGUF blocks [N, K / 32 * block bytes] -> the [N, K] weight (gguf.quants.dequantize's values in fp32;
    float64 gives the exact values)."""
    d, m, q = _fields(fmt, blocks)
    d, q = d.to(dtype).unsqueeze(-1), q.to(dtype)
    w = d * (q - 8) if fmt == "Q4_0" else d * q
    if m is not None:
        w = w + m.to(dtype).unsqueeze(-1)
    return w.reshape(blocks.shape[0], k)


def quantize(fmt: str, weight: torch.Tensor) -> torch.Tensor:
    """A dense [N, K] weight -> GGUF blocks [N, K / 32 * block bytes] uint8, with ggml's reference quantizer
    (gguf-py's numpy port, bit-exact with llama.cpp's for these formats)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"{fmt} needs in_features divisible by {BLOCK}, got {k}")
    array = weight.detach().float().contiguous().numpy()
    blocks = gguf_quantize(array, GGMLQuantizationType(FORMATS[fmt]))
    return torch.from_numpy(np.ascontiguousarray(blocks)).view(n, k // BLOCK * BLOCK_BYTES[fmt])


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K] int32 in -127..127, scales dx [M, K / 32] fp32), the kernel's activation
    quantization: dx = amax / 127, codes round_half_even(x * (127 / amax)) (0 for an all-zero block)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = xb.abs().amax(-1)  # [M, B]
    scale = amax / 127
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    codes = torch.round(xb * inv.unsqueeze(-1)).clamp_(-127, 127)
    return codes.int().reshape(m, k), scale


def gemm_ref(x: torch.Tensor, fmt: str, blocks: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, summed in float64: the dequantized activation times the dequantized weight,
    + bias, one rounding to x's dtype."""
    k = x.shape[1]
    codes, scale = quantize_rows_ref(x)
    xd = (codes.double().view(x.shape[0], -1, BLOCK) * scale.double().unsqueeze(-1)).view_as(codes)
    out = F.linear(xd, dequantize(fmt, blocks, k, torch.float64), None if bias is None else bias.double())
    return out.to(x.dtype)
