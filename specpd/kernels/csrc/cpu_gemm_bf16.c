/* Few-row bf16 GEMM on AVX512-BF16: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), bf16 in and out, fp32 sums.
   Decode and verify multiply 1..32 rows by every weight of the model: the step is the time it takes to read
   the weights once. The weight is packed once at load (specpd_gemm_bf16_pack) into blocks of 16 output
   columns x 2 inputs, one 64-byte vector each, [N/16][K/2][16][2]: a block's whole K is one contiguous stream,
   and one vdpbf16ps multiplies a vector by a pair of x's inputs (broadcast), adding both products to the 16
   columns' fp32 sums. Four blocks (64 columns) are read side by side, by up to 6 rows at a time.

   Batch invariance by construction: an output element is always the same chain of dot products over K in
   the same order, whatever M, the row tile or the thread split; so a row's result never depends on the rows
   beside it (speculative verify rows round exactly as the same rows decoded alone). The bias is added to the
   fp32 sum, then one rounding to bf16 (nearest even, as torch).

   Threads: OpenMP (torch's pool, see specpd/kernels/build.py); each thread takes a contiguous range of
   column blocks. Without AVX512-BF16 the library builds and specpd_gemm_bf16_available returns 0. */
#include <stdint.h>
#include <string.h>
#include <omp.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
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
#define MR_MAX 6

/* MR rows x NB column blocks: acc[r][j] += x[r] pairs . w blocks, over the whole K, then bias, round, store.
   x: the tile's first row (row stride kp_count pairs); w: the first block; y: the tile's first output. */
#define TILE(MR, NB)                                                                                        \
  static void tile_##MR##_##NB(const uint32_t* x, int64_t kp_count, const uint16_t* w, const float* bias,  \
                               uint16_t* y, int64_t ldy, int64_t n_left) {                                 \
    __m512 acc[MR][NB];                                                                                     \
    for (int r = 0; r < MR; r++)                                                                            \
      for (int j = 0; j < NB; j++) acc[r][j] = _mm512_setzero_ps();                                         \
    for (int64_t kp = 0; kp < kp_count; kp++) {                                                             \
      __m512bh wv[NB];                                                                                      \
      for (int j = 0; j < NB; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + (j * kp_count + kp) * 32);     \
      for (int r = 0; r < MR; r++) {                                                                        \
        __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[r * kp_count + kp]);                               \
        for (int j = 0; j < NB; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);                    \
      }                                                                                                     \
    }                                                                                                       \
    for (int j = 0; j < NB; j++) {                                                                          \
      int64_t cols = n_left - 16 * j;                                                                       \
      __mmask16 mask = cols >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1);                      \
      __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();                   \
      for (int r = 0; r < MR; r++)                                                                          \
        _mm256_mask_storeu_epi16(y + r * ldy + 16 * j, mask,                                               \
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], b)));                 \
    }                                                                                                       \
  }
#define TILES(MR) TILE(MR, 4) TILE(MR, 1)
TILES(1) TILES(2) TILES(3) TILES(4) TILES(5) TILES(6)

typedef void (*tile_fn)(const uint32_t*, int64_t, const uint16_t*, const float*, uint16_t*, int64_t, int64_t);
static const tile_fn TILE4[MR_MAX + 1] = {0, tile_1_4, tile_2_4, tile_3_4, tile_4_4, tile_5_4, tile_6_4};
static const tile_fn TILE1[MR_MAX + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1};
#endif

/* x [M, K] bf16 contiguous, packed from specpd_gemm_bf16_pack, bias [N] fp32 or NULL, y [M, N] bf16. */
int specpd_gemm_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed, const float* bias,
                     int64_t N, uint16_t* y) {
#ifdef __AVX512BF16__
  if (K % 2) return 1;
  int64_t kp_count = K / 2, nb_count = (N + 15) / 16, block = kp_count * 32;
  const uint32_t* xp = (const uint32_t*)x;
  #pragma omp parallel
  {
    int threads = omp_get_num_threads(), t = omp_get_thread_num();
    int64_t lo = nb_count * t / threads, hi = nb_count * (t + 1) / threads;
    for (int64_t nb = lo; nb < hi;) {
      int wide = hi - nb >= 4;
      const tile_fn* fns = wide ? TILE4 : TILE1;
      for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
        int64_t mr = M - m0 < MR_MAX ? M - m0 : MR_MAX;
        fns[mr](xp + m0 * kp_count, kp_count, packed + nb * block, bias ? bias + nb * 16 : 0,
                y + m0 * N + nb * 16, N, N - nb * 16);
      }
      nb += wide ? 4 : 1;
    }
  }
  return 0;
#else
  (void)x; (void)M; (void)K; (void)packed; (void)bias; (void)N; (void)y;
  return 2;
#endif
}
