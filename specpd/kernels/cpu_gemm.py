"""Few-row fp32 GEMM for CPU: y [M, N] = x [M, K] @ W, for the 1..MAX_ROWS rows of decode, verify and batched decode.

Why: a forward over M = 2..16 rows should cost what reading the weights costs, as M = 1 does. MKL's
sgemm does not get there: on SmolLM2-135M (1 thread, AVX-512) a T = 8 row verify spent 1.6x the
decode forward's time in matmuls (evals/results/profile_forward.json "before"): its small-M path packs
the weight on every call. This kernel reads a weight packed once at load time into column panels
`[N / 16, K, 16]` (one zmm wide), four panels at a time from four places in the weight (four
sequential streams, each prefetched 2 KiB ahead: one stream alone left ~15% of the bandwidth unused),
and keeps every row's accumulators of those panels in registers (one block of up to 8 rows, or blocks
of 6 beyond that), so the weight streams from memory once whatever M is (for 9..64 rows the panels
are re-read from L2 by each block). With AVX-512, M = 1 stays on MKL's gemv, which streams [K, N] as fast.

The reference is `x @ w_t` (matmul_ref); results are allclose, not bit-identical (the sum order over
K differs from MKL's). The kernel is C with AVX-512 intrinsics (or AVX2 + FMA where the CPU has no
AVX-512: `_SOURCE_AVX2`, one-ymm panels read as 4, 3 or 2 streams by row count, M = 1 included: see
there), compiled on first use with the system
C compiler into $SPECPD_CACHE (default ~/.cache/specpd)/kernels/ and called through ctypes (which
releases the GIL). It is single-threaded: `few_row_matmul` takes it only when torch runs one thread
(the CPU serving setting, --num-threads 1); without a compiler, without AVX-512 or AVX2, or with
SPECPD_CPU_GEMM=0 everything falls back to torch.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import weakref

import torch
import torch.nn.functional as F

# isa -> (columns per packed panel, what the panel count is padded to a multiple of): AVX-512 one zmm and
# 4 streams; AVX2 one ymm and 4, 3 or 2 streams
LAYOUT = {"avx512": (16, 4), "avx2": (8, 12)}
MAX_ROWS = 64  # up to here it beats MKL (b8 verify T=8 is 64 rows); longer prefill chunks go to MKL

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#define PW 16       /* columns per panel: one zmm */
#define NS 4        /* panels streamed together, from 4 places in the weight */
#define PFD 512     /* floats ahead to prefetch in each stream: 2 KiB */
#define DEF_BLOCK(R) \
static void block_##R(const float* restrict x, int64_t ldx, const float* const* w, int64_t K, \
                      float* const* y, int64_t ldy, const __mmask16* mask) { \
  __m512 a[NS][R]; \
  _Pragma("GCC unroll 4") for (int s = 0; s < NS; s++) \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) a[s][r] = _mm512_setzero_ps(); \
  const float* w0 = w[0]; const float* w1 = w[1]; const float* w2 = w[2]; const float* w3 = w[3]; \
  for (int64_t k = 0; k < K; k++) { \
    _mm_prefetch((const char*)(w0 + k * PW + PFD), _MM_HINT_T0); \
    _mm_prefetch((const char*)(w1 + k * PW + PFD), _MM_HINT_T0); \
    _mm_prefetch((const char*)(w2 + k * PW + PFD), _MM_HINT_T0); \
    _mm_prefetch((const char*)(w3 + k * PW + PFD), _MM_HINT_T0); \
    __m512 v0 = _mm512_loadu_ps(w0 + k * PW), v1 = _mm512_loadu_ps(w1 + k * PW); \
    __m512 v2 = _mm512_loadu_ps(w2 + k * PW), v3 = _mm512_loadu_ps(w3 + k * PW); \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) { \
      __m512 b = _mm512_set1_ps(x[r * ldx + k]); \
      a[0][r] = _mm512_fmadd_ps(b, v0, a[0][r]); a[1][r] = _mm512_fmadd_ps(b, v1, a[1][r]); \
      a[2][r] = _mm512_fmadd_ps(b, v2, a[2][r]); a[3][r] = _mm512_fmadd_ps(b, v3, a[3][r]); } \
  } \
  _Pragma("GCC unroll 4") for (int s = 0; s < NS; s++) \
    if (mask[s]) _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y[s] + r * ldy, mask[s], a[s][r]); \
}
DEF_BLOCK(1) DEF_BLOCK(2) DEF_BLOCK(3) DEF_BLOCK(4) DEF_BLOCK(5) DEF_BLOCK(6) DEF_BLOCK(7) DEF_BLOCK(8)
typedef void (*block_fn)(const float*, int64_t, const float* const*, int64_t, float* const*, int64_t, const __mmask16*);
static const block_fn BLOCKS[9] = {0, block_1, block_2, block_3, block_4, block_5, block_6, block_7, block_8};

/* x [M, K] row-major; wp [np, K, 16] with np a multiple of 4 (columns past N zero); y [M, N] row-major.
   Stream s of step p reads panel p + s * np / 4, so four sequential streams run at once. */
void specpd_gemm_packed(const float* x, int64_t M, int64_t K, const float* wp, int64_t N, float* y) {
  int64_t per = (N + PW * NS - 1) / (PW * NS);
  for (int64_t p = 0; p < per; p++) {
    const float* w[NS];
    __mmask16 mask[NS];
    int64_t col[NS];
    for (int s = 0; s < NS; s++) {
      int64_t q = p + s * per;
      int64_t valid = N - q * PW;
      w[s] = wp + q * K * PW;
      col[s] = q * PW;
      mask[s] = valid >= PW ? (__mmask16)0xFFFF : valid <= 0 ? (__mmask16)0 : (__mmask16)((1u << valid) - 1);
    }
    /* up to 8 rows: one pass over the weight (memory-bound); more: blocks of 6, whose 24
       accumulators + 4 weight vectors fit the 32 zmm (8 rows spill, which shows once compute-bound) */
    int64_t rb = M <= 8 ? M : 6;
    for (int64_t m0 = 0; m0 < M; m0 += rb) {
      int64_t r = M - m0 < rb ? M - m0 : rb;
      float* ys[NS];
      for (int s = 0; s < NS; s++) ys[s] = y + m0 * N + (mask[s] ? col[s] : 0);
      BLOCKS[r](x + m0 * K, K, w, K, ys, N, mask);
    }
  }
}
"""

# The kernel for CPUs with AVX2 + FMA and no AVX-512 (e.g. AMD EPYC before Zen 4). Its panels are one ymm
# wide, [P, K, 8] with P a multiple of 12, and a call reads S = 4, 3 or 2 of them at once from S places in the
# weight (S sequential streams): 16 ymm hold S x R accumulators, S weight vectors and the broadcast, so
# 4 streams take blocks of up to 3 rows, 3 streams 4, 2 streams 6. Measured on SmolLM2's decoder (1 thread,
# AMD EPYC, 30 layers' matmuls): up to 3 rows the weight read is the cost with 4 streams; 4 rows take 3
# streams and 5+ rows 2, where one pass of 6 rows stays at the read's cost and more rows split into even
# blocks. K runs in chunks of KC: a chunk's panels (8 KiB at most) stay in L1 while every row block reads
# them, and each block issues its share of the prefetches two chunks ahead, so the streams keep flowing
# while the later blocks compute (one block streaming, the rest idle on memory, cost 1.4x at 8 rows).
# One row is no special case: this kernel streams a gemv faster than MKL's on that CPU (-15..20%).
_SOURCE_AVX2 = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#define PW 8        /* columns per packed panel: one ymm */
#define KC 64       /* k per chunk: a chunk of a panel is 2 KiB */
#define PFC 2       /* chunks ahead to prefetch */
#define MAXM 64     /* rows per pass over the weight (the accumulator buffer's) */
/* One block: R rows x S streams of one-ymm panels over k0..k1. T: the weight's element type, LOAD(p): its 8
   values at p as fp32 (bf16: the 16 bits shifted into the high half, exact). */
#define DEF_BLOCK(NAME, T, LOAD, S, R) \
static void NAME##_##S##_##R(const float* restrict x, int64_t ldx, const T* const* w, int64_t k0, int64_t k1, \
                             float* restrict acc, int first, int block, int nblocks) { \
  __m256 a[S][R]; \
  _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) _Pragma("GCC unroll 4") for (int s = 0; s < S; s++) \
    a[s][r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + (r * S + s) * PW); \
  /* blocks take turns per 64-byte line of a panel (2 k of fp32, 4 of bf16) */ \
  const int64_t line = 64 / (PW * sizeof(T)); \
  int64_t next_pf = k0 + line * block; \
  for (int64_t k = k0; k < k1; k++) { \
    if (k == next_pf) { \
      next_pf += line * nblocks; \
      _Pragma("GCC unroll 4") for (int s = 0; s < S; s++) \
        _mm_prefetch((const char*)(w[s] + (k + PFC * KC) * PW), _MM_HINT_T0); } \
    __m256 v[S]; \
    _Pragma("GCC unroll 4") for (int s = 0; s < S; s++) v[s] = LOAD(w[s] + k * PW); \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) { \
      __m256 b = _mm256_broadcast_ss(x + r * ldx + k); \
      _Pragma("GCC unroll 4") for (int s = 0; s < S; s++) a[s][r] = _mm256_fmadd_ps(b, v[s], a[s][r]); } \
  } \
  _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) _Pragma("GCC unroll 4") for (int s = 0; s < S; s++) \
    _mm256_storeu_ps(acc + (r * S + s) * PW, a[s][r]); \
}
#define LOAD_F32(p) _mm256_loadu_ps(p)
#define LOAD_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p))), 16))

/* x [M, K] row-major (M <= MAXM); wp [np, K, 8], np a multiple of 12 (columns past N zero); y [M, N]
   row-major. Stream s of step p reads panel p + s * np / S. */
#define DEF_GEMM(NAME, T, LOAD) \
DEF_BLOCK(NAME, T, LOAD, 4, 1) DEF_BLOCK(NAME, T, LOAD, 4, 2) DEF_BLOCK(NAME, T, LOAD, 4, 3) \
DEF_BLOCK(NAME, T, LOAD, 3, 1) DEF_BLOCK(NAME, T, LOAD, 3, 2) DEF_BLOCK(NAME, T, LOAD, 3, 3) DEF_BLOCK(NAME, T, LOAD, 3, 4) \
DEF_BLOCK(NAME, T, LOAD, 2, 1) DEF_BLOCK(NAME, T, LOAD, 2, 2) DEF_BLOCK(NAME, T, LOAD, 2, 3) \
DEF_BLOCK(NAME, T, LOAD, 2, 4) DEF_BLOCK(NAME, T, LOAD, 2, 5) DEF_BLOCK(NAME, T, LOAD, 2, 6) \
typedef void (*NAME##_fn)(const float*, int64_t, const T* const*, int64_t, int64_t, float*, int, int, int); \
static const NAME##_fn NAME##S[5][7] = { \
  {0}, {0}, \
  {0, NAME##_2_1, NAME##_2_2, NAME##_2_3, NAME##_2_4, NAME##_2_5, NAME##_2_6}, \
  {0, NAME##_3_1, NAME##_3_2, NAME##_3_3, NAME##_3_4}, \
  {0, NAME##_4_1, NAME##_4_2, NAME##_4_3}}; \
static void NAME##_rows(const float* x, int64_t M, int64_t K, const T* wp, int64_t N, float* y, int S) { \
  int64_t np = ((N + PW - 1) / PW + 11) / 12 * 12, per = np / S; \
  float acc[MAXM * 4 * PW] __attribute__((aligned(32)));  /* [M][S][8] partial sums of the step's panels */ \
  int64_t nblocks = (M + MAX_BLOCK_ROWS[S] - 1) / MAX_BLOCK_ROWS[S], rows = M / nblocks, extra = M % nblocks; \
  for (int64_t p = 0; p < per; p++) { \
    const T* w[4]; \
    for (int s = 0; s < S; s++) w[s] = wp + (p + s * per) * K * PW; \
    for (int64_t k0 = 0; k0 < K; k0 += KC) { \
      int64_t k1 = k0 + KC < K ? k0 + KC : K, m0 = 0; \
      for (int64_t b = 0; b < nblocks; b++) {  /* even blocks: 8 rows are 4 + 4, not 6 + 2 */ \
        int64_t r = rows + (b < extra); \
        NAME##S[S][r](x + m0 * K, K, w, k0, k1, acc + m0 * S * PW, k0 == 0, (int)b, (int)nblocks); \
        m0 += r; \
      } \
    } \
    for (int s = 0; s < S; s++) { \
      int64_t col = (p + s * per) * PW, valid = N - col < PW ? N - col : PW; \
      if (valid > 0) \
        for (int64_t m = 0; m < M; m++) memcpy(y + m * N + col, acc + (m * S + s) * PW, (size_t)valid * sizeof(float)); \
    } \
  } \
}
static const int MAX_BLOCK_ROWS[5] = {0, 0, 6, 4, 3};
DEF_GEMM(f32, float, LOAD_F32)
DEF_GEMM(bf16, uint16_t, LOAD_BF16)

void specpd_gemm_packed(const float* x, int64_t M, int64_t K, const float* wp, int64_t N, float* y) {
  int S = M <= 3 ? 4 : M == 4 ? 3 : 2;
  for (int64_t m0 = 0; m0 < M; m0 += MAXM)
    f32_rows(x + m0 * K, M - m0 < MAXM ? M - m0 : MAXM, K, wp, N, y + m0 * N, S);
}

/* The same with a bf16 weight (packed the same way): half the bytes to stream, the same products and sum
   order as specpd_gemm_packed over that weight in fp32, so the same result bit for bit. */
void specpd_gemm_packed_bf16(const float* x, int64_t M, int64_t K, const uint16_t* wp, int64_t N, float* y) {
  int S = M <= 3 ? 4 : M == 4 ? 3 : 2;
  for (int64_t m0 = 0; m0 < M; m0 += MAXM)
    bf16_rows(x + m0 * K, M - m0 < MAXM ? M - m0 : MAXM, K, wp, N, y + m0 * N, S);
}
"""


def _cache_dir() -> str:
    from specpd.model.default import cache_root
    return os.path.join(cache_root(), "kernels")


@functools.cache
def _cpu_isa() -> str | None:
    """'avx512' or 'avx2' (with FMA), the kernel this CPU runs; None: neither (torch's matmul then)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return None
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags and "fma" in flags else None


@functools.cache
def _kernel():
    """The compiled specpd_gemm_packed for this CPU, or None where it cannot be built or run."""
    if os.environ.get("SPECPD_CPU_GEMM", "1") == "0":
        return None
    return build(_cpu_isa())


@functools.cache
def _kernel_bf16():
    """specpd_gemm_packed_bf16 (a bf16 weight) for this CPU where it has one (the AVX2 source), else None."""
    return build(_cpu_isa(), bf16=True) if _kernel() is not None else None


@functools.cache
def _library(isa: str):
    """The compiled source for `isa`, or None without a compiler."""
    source, flags = (_SOURCE, ["-mavx512f", "-mfma"]) if isa == "avx512" else (_SOURCE_AVX2, ["-mavx2", "-mfma"])
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    path = os.path.join(_cache_dir(), f"cpu_gemm-{digest}.so")
    if not os.path.isfile(path):
        try:
            os.makedirs(_cache_dir(), exist_ok=True)
            with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
                src, out = os.path.join(tmp, "cpu_gemm.c"), os.path.join(tmp, "cpu_gemm.so")
                with open(src, "w", encoding="utf-8") as f:
                    f.write(source)
                subprocess.run([cc, "-O3", *flags, "-shared", "-fPIC", "-o", out, src],
                               check=True, capture_output=True, timeout=120)
                os.replace(out, path)  # atomic: concurrent builders see the whole file or none
        except (OSError, subprocess.SubprocessError):
            return None
    return ctypes.CDLL(path)


@functools.cache
def build(isa: str | None, bf16: bool = False):
    """The kernel for `isa` ('avx512' or 'avx2'), compiled once; None without a compiler or for another isa
    (the caller checks the CPU runs it: tests build both where the CPU has AVX-512). bf16: the variant over a
    bf16 weight (AVX2 only; None for AVX-512)."""
    if isa not in ("avx512", "avx2") or (bf16 and isa != "avx2"):
        return None
    lib = _library(isa)
    if lib is None:
        return None
    fn = lib.specpd_gemm_packed_bf16 if bf16 else lib.specpd_gemm_packed
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p]
    fn.restype = None
    return fn


def available() -> bool:
    return _kernel() is not None


def pack_weight(weight_t: torch.Tensor, isa: str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[K, N] (the [in, out] weight) -> panels [P, K, width] in `dtype` (fp32, or bf16 for the AVX2 kernel's
    bf16 variant), zero-padded columns, in the layout of `isa`'s kernel (default: this CPU's): width 16 and P
    a multiple of 4 (AVX-512), 8 and 12 (AVX2)."""
    width, multiple = LAYOUT[isa or _cpu_isa() or "avx512"]
    k, n = weight_t.shape
    panels = -(-n // (width * multiple)) * multiple
    padded = weight_t.new_zeros(k, panels * width, dtype=dtype)
    padded[:, :n] = weight_t
    return padded.view(k, panels, width).transpose(0, 1).contiguous()


def pack_exact(weight_t: torch.Tensor) -> torch.Tensor:
    """pack_weight for this CPU in bf16 when every value of the weight is a bf16 (a head exported in bf16 and
    loaded in fp32) and the CPU has the bf16 variant: half the bytes, the same result bit for bit; else fp32."""
    if _kernel_bf16() is not None and _all_bf16(weight_t):
        return pack_weight(weight_t, dtype=torch.bfloat16)
    return pack_weight(weight_t)


def _all_bf16(w: torch.Tensor) -> bool:
    """Every fp32 value is a bf16 one: its low 16 bits are zero. A sample first, so that a trained fp32
    weight (the target's) is turned down without reading all of it."""
    if w.dtype != torch.float32:
        return False
    low_bits = lambda t: (t.contiguous().view(torch.int32) & 0xFFFF).any()  # noqa: E731
    sample = w[:max(1, 4096 // max(1, w[0].numel()))]  # leading rows: no full copy of a transposed view
    return not low_bits(sample) and not low_bits(w)


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, n: int, kernel=None) -> torch.Tensor:
    """x [M, K] fp32 (any M) @ the packed weight (fp32, or bf16: the bf16 variant) -> [M, n]. Needs
    available() (or `kernel`, from build)."""
    x = x.contiguous()
    m, k = x.shape
    if packed.shape[1] != k or packed.shape[0] * packed.shape[2] < n or x.dtype != torch.float32:
        raise ValueError(f"packed_matmul: x {tuple(x.shape)} {x.dtype} vs packed {tuple(packed.shape)} for n={n}")
    if kernel is None:
        kernel = _kernel_bf16() if packed.dtype == torch.bfloat16 else _kernel()
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    kernel(x.data_ptr(), m, k, packed.data_ptr(), n, y.data_ptr())
    return y


def matmul_ref(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """The torch reference: x [M, K] @ weight_t [K, N]."""
    return x @ weight_t


@functools.cache
def min_rows() -> int:
    """The fewest rows the kernel takes: 1 with AVX2 (it streams a gemv faster than MKL's on such a CPU), 2
    with AVX-512 (MKL's gemv streams [K, N] as fast there)."""
    return 1 if _cpu_isa() == "avx2" else 2


def use_packed(x: torch.Tensor) -> bool:
    """Whether few_row_matmul / linear take the kernel for this input (it has no backward: never under autograd)."""
    return (x.dim() == 2 and min_rows() <= x.shape[0] <= MAX_ROWS and x.dtype == torch.float32
            and x.device.type == "cpu" and not torch.is_grad_enabled() and torch.get_num_threads() == 1)


def few_row_matmul(x: torch.Tensor, weight_t: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight_t [K, N]: the packed kernel for min_rows()..MAX_ROWS fp32 rows, else torch."""
    if packed is not None and use_packed(x):
        return packed_matmul(x, packed, weight_t.shape[1])
    return x @ weight_t


# id(weight [out, in]) -> (weakref to it, data_ptr, version, packed): the draft models' nn.Linear
# weights, packed on first use; an entry goes when its weight is freed (tensors cannot be weak keys:
# their == is elementwise)
_PACKED: dict[int, tuple[weakref.ref, int, int, torch.Tensor]] = {}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight [out, in], bias), through the kernel for min_rows()..MAX_ROWS fp32 rows.

    For modules that keep nn.Linear's layout (the draft heads and layers). The packed copy is cached
    per weight tensor and rebuilt when the weight's storage or version changes (an in-place update)."""
    if weight.dtype != torch.float32 or not use_packed(x) or not available():
        return F.linear(x, weight, bias)
    key = id(weight)
    entry = _PACKED.get(key)
    if entry is None or entry[0]() is not weight or entry[1:3] != (weight.data_ptr(), weight._version):
        if entry is None or entry[0]() is not weight:
            weakref.finalize(weight, _PACKED.pop, key, None)
        entry = (weakref.ref(weight), weight.data_ptr(), weight._version, pack_exact(weight.detach().t()))
        _PACKED[key] = entry
    out = packed_matmul(x, entry[3], weight.shape[0])
    return out if bias is None else out + bias
