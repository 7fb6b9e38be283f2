/* Few-row bf16 GEMM on AVX512-BF16: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), bf16 in and out, fp32 sums.
   Decode and verify multiply 1..32 rows by every weight of the model: the step is the time it takes to read
   the weights once. The weight is packed once at load (specpd_gemm_bf16_pack) into blocks of 16 output
   columns x 2 inputs, one 64-byte vector each, [N/16][K/2][16][2]: a block's whole K is one contiguous stream,
   and one vdpbf16ps multiplies a vector by a pair of x's inputs (broadcast), adding both products to the 16
   columns' fp32 sums. Four blocks (64 columns) are read side by side by up to 6 rows at a time, or from 7 rows on
   three blocks (48 columns) by up to 8 rows (24 accumulators either way): a verify tree's 8 rows then read each
   weight once, not twice (6 + 2), and 16 rows twice, not three times (6 + 6 + 4). On a Zen 4 EPYC, one
   forward's linears: 1.12x faster at 7 and 8 rows, 1.09x at 12, 1.06x at 16, 1.02-1.07x at 24-32, alike at 48-64.

   Batch invariance by construction: an output element is always the same chain of dot products over K in
   the same order, whatever M, the row tile or the thread split; so a row's result never depends on the rows
   beside it (speculative verify rows round exactly as the same rows decoded alone). The bias is added to the
   fp32 sum, then one rounding to bf16 (nearest even, as torch).

   AMX (specpd_gemm_bf16_use_amx): the same packed layout is what a tile multiply reads as its B operand (one
   k-block of a column block = 16 pairs x 16 columns x 2 = one 1 KB tile, 64-byte rows), so on CPUs with AMX
   tiles of up to 16 rows x 32 inputs are multiplied by 1..4 column blocks at once (tdpbf16ps), rows 1..16
   costing what reading the weight costs. Still invariant by construction: an output element is the same chain
   of tile products over K in the same order whatever M; it rounds differently from the vdpbf16ps path, and
   one process uses one path for every weight whose K is a multiple of 32 (the others keep vdpbf16ps).

   Threads: OpenMP (torch's pool, see specpd/kernels/build.py); each thread takes a contiguous range of
   column blocks. Without AVX512-BF16 the library builds and specpd_gemm_bf16_available returns 0. */
#include <stdint.h>
#include <string.h>
#include <omp.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SPECPD_AMX 1
#include "amx.h"
#endif

int specpd_gemm_bf16_available(void) {
#ifdef __AVX512BF16__
  return 1;
#else
  return 0;
#endif
}

/* w [N, K] bf16 (row-major) -> packed [ceil(N/16)][K/2][16][2], zero past N. K must be even. */
int specpd_gemm_bf16_pack(const uint16_t* w, int64_t N, int64_t K, uint16_t* packed) {
  if (K % 2) return 1;
  int64_t nb_count = (N + 15) / 16, kp_count = K / 2;
  #pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < nb_count; nb++) {
    uint16_t* dst = packed + nb * kp_count * 32;
    for (int64_t kp = 0; kp < kp_count; kp++)
      for (int64_t c = 0; c < 16; c++) {
        int64_t n = nb * 16 + c;
        dst[(kp * 16 + c) * 2] = n < N ? w[n * K + 2 * kp] : 0;
        dst[(kp * 16 + c) * 2 + 1] = n < N ? w[n * K + 2 * kp + 1] : 0;
      }
  }
  return 0;
}

#ifdef __AVX512BF16__
#define MR_MAX 6   /* rows a tile of four column blocks takes (up to 6 rows in all) */
#define MR_WIDE 8  /* rows a tile of three column blocks takes (7 rows and more) */
/* Each block's weight stream is asked for W_AHEAD 64-byte lines (2 KB) ahead, into L2 (prefetcht2; a hint, no
   result changes): a tile reads four short streams (18 KB each at K = 576) and the next tile four new ones, too
   short for the hardware prefetchers to ramp up on. On a Zen 4 EPYC, one forward's linears, old and new kernel
   alternated: 1.04-1.17x faster from 1 to 64 rows while the box was loaded (the weights streaming at ~25 GB/s),
   0.99-1.02x while it was quiet (~30 GB/s); 16 lines ahead gained less, 64 alike, into L1 (prefetcht0) lost
   2-10%. Prefetching past a buffer's end does not fault. */
#define W_AHEAD 32

/* columns [0, cols) of a block of 16 (all of them short of the last block) */
static inline __mmask16 col_mask(int64_t cols) {
  return cols >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1);
}

/* the epilogue of both paths: the bias added to the fp32 sums, one rounding to bf16, the masked columns stored */
static inline void store_bf16(uint16_t* y, __mmask16 mask, __m512 sums, __m512 bias) {
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sums, bias)));
}

/* MR rows x NB column blocks: acc[r][j] += x[r] pairs . w blocks, over the whole K, then bias, round, store.
   x: the tile's first row (row stride kp_count pairs); w: the first block; y: the tile's first output. */
#define TILE(MR, NB)                                                                                        \
  static void tile_##MR##_##NB(const uint32_t* x, int64_t kp_count, const uint16_t* w, const float* bias,  \
                               uint16_t* y, int64_t ldy, int64_t n_left) {                                 \
    __m512 acc[MR][NB];                                                                                     \
    for (int r = 0; r < MR; r++)                                                                            \
      for (int j = 0; j < NB; j++) acc[r][j] = _mm512_setzero_ps();                                         \
    for (int64_t kp = 0; kp < kp_count; kp++) {                                                             \
      for (int j = 0; j < NB; j++) __builtin_prefetch(w + (j * kp_count + kp + W_AHEAD) * 32, 0, 1);       \
      __m512bh wv[NB];                                                                                      \
      for (int j = 0; j < NB; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + (j * kp_count + kp) * 32);     \
      for (int r = 0; r < MR; r++) {                                                                        \
        __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[r * kp_count + kp]);                               \
        for (int j = 0; j < NB; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);                    \
      }                                                                                                     \
    }                                                                                                       \
    for (int j = 0; j < NB; j++) {                                                                          \
      __mmask16 mask = col_mask(n_left - 16 * j);                                                           \
      __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();                   \
      for (int r = 0; r < MR; r++) store_bf16(y + r * ldy + 16 * j, mask, acc[r][j], b);                    \
    }                                                                                                       \
  }
#define TILES(MR) TILE(MR, 4) TILE(MR, 1)
TILES(1) TILES(2) TILES(3) TILES(4) TILES(5) TILES(6) TILE(7, 1) TILE(8, 1)
TILE(1, 3) TILE(2, 3) TILE(3, 3) TILE(4, 3) TILE(5, 3) TILE(6, 3) TILE(7, 3) TILE(8, 3)

typedef void (*tile_fn)(const uint32_t*, int64_t, const uint16_t*, const float*, uint16_t*, int64_t, int64_t);
static const tile_fn TILE4[MR_MAX + 1] = {0, tile_1_4, tile_2_4, tile_3_4, tile_4_4, tile_5_4, tile_6_4};
static const tile_fn TILE3[MR_WIDE + 1] = {0, tile_1_3, tile_2_3, tile_3_3, tile_4_3, tile_5_3, tile_6_3, tile_7_3,
                                           tile_8_3};
static const tile_fn TILE1[MR_WIDE + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1, tile_7_1,
                                           tile_8_1};
#endif

#ifdef SPECPD_AMX
static int use_amx = 0;

/* Use the AMX tiles when `on` and Linux grants their state; returns whether they are used. */
int specpd_gemm_bf16_use_amx(int on) {
  use_amx = on && amx_request();
  return use_amx;
}

/* tmm0..3: four column blocks' fp32 sums (mr x 16); tmm4: x, mr rows x 32 inputs; tmm5..7: weight tiles. */
static void amx_configure(int mr) {
  int rows[8], colsb[8];
  for (int t = 0; t < 8; t++) {
    rows[t] = t < 5 ? mr : 16;
    colsb[t] = 64;
  }
  amx_load_config(rows, colsb);
}

/* store_bf16 over sums[mr][64] (nb blocks of 16 columns), as the vector path's tiles end */
static void amx_store(const float* sums, int mr, int nb, const float* bias, uint16_t* y, int64_t ldy,
                      int64_t n_left) {
  for (int j = 0; j < nb; j++) {
    __mmask16 mask = col_mask(n_left - 16 * j);
    __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
    for (int r = 0; r < mr; r++) store_bf16(y + r * ldy + 16 * j, mask, _mm512_loadu_ps(sums + r * 64 + 16 * j), b);
  }
}

/* mr (configured) rows x 4 column blocks over the whole K; w: the first block, `block` elements apart. */
static void amx_tile4(const uint16_t* x, int64_t K, const uint16_t* w, int64_t block, float* sums) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t kb = 0; kb < K / 32; kb++) {
    const uint16_t* wk = w + kb * 512;
    _tile_loadd(4, x + kb * 32, K * 2);
    _tile_loadd(5, wk, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, wk + block, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, wk + 2 * block, 64);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, wk + 3 * block, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, sums, 256); _tile_stored(1, sums + 16, 256);
  _tile_stored(2, sums + 32, 256); _tile_stored(3, sums + 48, 256);
}

/* 32 rows x 2 column blocks (configured for 16-row tiles): two x tiles and two weight tiles per k-block feed four
   products, one load a product where amx_tile4 takes 1.25 (wide GEMMs: prefill chunks, big batches). Each
   output element is the same chain of tile products as in amx_tile4 and amx_tile1. sums: [32][64] floats. */
static void amx_tile22(const uint16_t* x, int64_t K, const uint16_t* w, int64_t block, float* sums) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t kb = 0; kb < K / 32; kb++) {
    const uint16_t* wk = w + kb * 512;
    _tile_loadd(4, x + kb * 32, K * 2);
    _tile_loadd(5, x + 16 * K + kb * 32, K * 2);
    _tile_loadd(6, wk, 64);
    _tile_loadd(7, wk + block, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, sums, 256); _tile_stored(1, sums + 16, 256);
  _tile_stored(2, sums + 16 * 64, 256); _tile_stored(3, sums + 16 * 64 + 16, 256);
}

static void amx_tile1(const uint16_t* x, int64_t K, const uint16_t* w, float* sums) {
  _tile_zero(0);
  for (int64_t kb = 0; kb < K / 32; kb++) {
    _tile_loadd(4, x + kb * 32, K * 2);
    _tile_loadd(5, w + kb * 512, 64);
    _tile_dpbf16ps(0, 4, 5);
  }
  _tile_stored(0, sums, 256);
}

static void amx_gemm(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed, const float* bias,
                     int64_t N, uint16_t* y) {
  int64_t nb_count = (N + 15) / 16, block = K / 2 * 32;
  #pragma omp parallel
  {
    int threads = omp_get_num_threads(), t = omp_get_thread_num();
    int64_t lo = nb_count * t / threads, hi = nb_count * (t + 1) / threads;
    float sums[32 * 64] __attribute__((aligned(64)));
    int configured = 0;
    for (int64_t nb = lo; nb < hi;) {
      int wide = hi - nb >= 4 ? 4 : 1;
      int64_t m0 = 0;
      if (wide == 4 && M >= 32) {
        if (configured != 16) amx_configure(configured = 16);
        for (; M - m0 >= 32; m0 += 32) {
          amx_tile22(x + m0 * K, K, packed + nb * block, block, sums);
          amx_tile22(x + m0 * K, K, packed + (nb + 2) * block, block, sums + 32);
          for (int h = 0; h < 2; h++)
            amx_store(sums + h * 16 * 64, 16, 4, bias ? bias + nb * 16 : 0, y + (m0 + 16 * h) * N + nb * 16, N,
                      N - nb * 16);
        }
      }
      for (; m0 < M; m0 += 16) {
        int mr = M - m0 < 16 ? (int)(M - m0) : 16;
        if (mr != configured) amx_configure(configured = mr);
        if (wide == 4) amx_tile4(x + m0 * K, K, packed + nb * block, block, sums);
        else amx_tile1(x + m0 * K, K, packed + nb * block, sums);
        amx_store(sums, mr, wide, bias ? bias + nb * 16 : 0, y + m0 * N + nb * 16, N, N - nb * 16);
      }
      nb += wide;
    }
    if (configured) _tile_release();
  }
}
#else
int specpd_gemm_bf16_use_amx(int on) {
  (void)on;
  return 0;
}
#endif

/* x [M, K] bf16 contiguous, packed from specpd_gemm_bf16_pack, bias [N] fp32 or NULL, y [M, N] bf16. */
int specpd_gemm_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed, const float* bias,
                     int64_t N, uint16_t* y) {
#ifdef __AVX512BF16__
  if (K % 2) return 1;
#ifdef SPECPD_AMX
  if (use_amx && K % 32 == 0) {
    amx_gemm(x, M, K, packed, bias, N, y);
    return 0;
  }
#endif
  int64_t kp_count = K / 2, nb_count = (N + 15) / 16, block = kp_count * 32;
  const uint32_t* xp = (const uint32_t*)x;
  #pragma omp parallel
  {
    int threads = omp_get_num_threads(), t = omp_get_thread_num();
    int64_t lo = nb_count * t / threads, hi = nb_count * (t + 1) / threads;
    const int many = M > MR_MAX;  /* tiles of 8 rows x 3 blocks, else 6 x 4 (the header) */
    const int64_t rows = many ? MR_WIDE : MR_MAX, blocks = many ? 3 : 4;
    for (int64_t nb = lo; nb < hi;) {
      int wide = hi - nb >= blocks;
      const tile_fn* fns = wide ? (many ? TILE3 : TILE4) : TILE1;
      for (int64_t m0 = 0; m0 < M; m0 += rows) {
        int64_t mr = M - m0 < rows ? M - m0 : rows;
        fns[mr](xp + m0 * kp_count, kp_count, packed + nb * block, bias ? bias + nb * 16 : 0,
                y + m0 * N + nb * 16, N, N - nb * 16);
      }
      nb += wide ? blocks : 1;
    }
  }
  return 0;
#else
  (void)x; (void)M; (void)K; (void)packed; (void)bias; (void)N; (void)y;
  return 2;
#endif
}
