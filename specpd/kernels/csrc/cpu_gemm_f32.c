/* fp32 GEMM on AVX-512: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 in and out. The fp32 sibling of
   cpu_gemm_bf16.c: the weight packed once at load into blocks of 16 output columns, [N/16][K][16] (one 64-byte
   vector per input), so a block's whole K is one contiguous stream; one FMA multiplies a vector by one of x's
   inputs (broadcast) into the 16 columns' sums. Four blocks (64 columns) are read side by side by up to 6 rows, or
   three blocks by up to 8 where that passes over the weights fewer times (cpu_gemm_bf16.c's tiles; a Zen 4 EPYC,
   one forward's linears: 1.10-1.13x at 7-8 rows, 1.09x at 16, 1.04-1.05x at 24-32).

   Batch invariance by construction: an output element is always the same chain of FMAs over K in order,
   whatever M, the row tile or the thread split (a verify row rounds exactly as the same row decoded alone).
   Threads: OpenMP, each a contiguous range of column blocks. Without AVX-512 the library builds and
   specpd_gemm_f32_available returns 0. */
#include <stdint.h>
#include <string.h>
#include <omp.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

int specpd_gemm_f32_available(void) {
#ifdef __AVX512F__
  return 1;
#else
  return 0;
#endif
}

/* w [N, K] fp32 (row-major) -> packed [ceil(N/16)][K][16], zero past N. */
int specpd_gemm_f32_pack(const float* w, int64_t N, int64_t K, float* packed) {
  int64_t nb_count = (N + 15) / 16;
  #pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < nb_count; nb++) {
    float* dst = packed + nb * K * 16;
    for (int64_t k = 0; k < K; k++)
      for (int64_t c = 0; c < 16; c++) {
        int64_t n = nb * 16 + c;
        dst[k * 16 + c] = n < N ? w[n * K + k] : 0.0f;
      }
  }
  return 0;
}

#ifdef __AVX512F__
#define F32_MR_MAX 6   /* rows a tile of four column blocks takes (up to 6 rows in all) */
#define F32_MR_WIDE 8  /* rows a tile of three column blocks takes (7 rows and more), as cpu_gemm_bf16.c's */
/* lines ahead in each block's weight stream, into L2, as cpu_gemm_bf16.c's W_AHEAD (a Zen 4 EPYC, loaded:
   1.03-1.08x from 1 to 8 rows, 1.00x at 16) */
#define F32_W_AHEAD 32

/* MR rows x NB column blocks over the whole K, then bias and a masked store. */
#define F32_TILE(MR, NB)                                                                                     \
  static void f32_tile_##MR##_##NB(const float* x, int64_t K, const float* w, const float* bias, float* y,  \
                                   int64_t ldy, int64_t n_left) {                                          \
    __m512 acc[MR][NB];                                                                                     \
    for (int r = 0; r < MR; r++)                                                                            \
      for (int j = 0; j < NB; j++) acc[r][j] = _mm512_setzero_ps();                                         \
    for (int64_t k = 0; k < K; k++) {                                                                       \
      for (int j = 0; j < NB; j++) __builtin_prefetch(w + (j * K + k + F32_W_AHEAD) * 16, 0, 1);           \
      __m512 wv[NB];                                                                                        \
      for (int j = 0; j < NB; j++) wv[j] = _mm512_loadu_ps(w + (j * K + k) * 16);                           \
      for (int r = 0; r < MR; r++) {                                                                        \
        __m512 xv = _mm512_set1_ps(x[r * K + k]);                                                           \
        for (int j = 0; j < NB; j++) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);                     \
      }                                                                                                     \
    }                                                                                                       \
    for (int j = 0; j < NB; j++) {                                                                          \
      int64_t cols = n_left - 16 * j;                                                                       \
      __mmask16 mask = cols >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1);                      \
      __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();                   \
      for (int r = 0; r < MR; r++) _mm512_mask_storeu_ps(y + r * ldy + 16 * j, mask, _mm512_add_ps(acc[r][j], b)); \
    }                                                                                                       \
  }
#define F32_TILES(MR) F32_TILE(MR, 4) F32_TILE(MR, 1)
F32_TILES(1) F32_TILES(2) F32_TILES(3) F32_TILES(4) F32_TILES(5) F32_TILES(6) F32_TILE(7, 1) F32_TILE(8, 1)
F32_TILE(1, 3) F32_TILE(2, 3) F32_TILE(3, 3) F32_TILE(4, 3) F32_TILE(5, 3) F32_TILE(6, 3) F32_TILE(7, 3)
F32_TILE(8, 3)

typedef void (*f32_tile_fn)(const float*, int64_t, const float*, const float*, float*, int64_t, int64_t);
static const f32_tile_fn F32_TILE4[F32_MR_MAX + 1] = {0, f32_tile_1_4, f32_tile_2_4, f32_tile_3_4, f32_tile_4_4,
                                                      f32_tile_5_4, f32_tile_6_4};
static const f32_tile_fn F32_TILE3[F32_MR_WIDE + 1] = {0, f32_tile_1_3, f32_tile_2_3, f32_tile_3_3, f32_tile_4_3,
                                                       f32_tile_5_3, f32_tile_6_3, f32_tile_7_3, f32_tile_8_3};
static const f32_tile_fn F32_TILE1[F32_MR_WIDE + 1] = {0, f32_tile_1_1, f32_tile_2_1, f32_tile_3_1, f32_tile_4_1,
                                                       f32_tile_5_1, f32_tile_6_1, f32_tile_7_1, f32_tile_8_1};
#endif

/* x [M, K] fp32 contiguous, packed from specpd_gemm_f32_pack, bias [N] fp32 or NULL, y [M, N] fp32. */
int specpd_gemm_f32(const float* x, int64_t M, int64_t K, const float* packed, const float* bias, int64_t N,
                    float* y) {
#ifdef __AVX512F__
  int64_t nb_count = (N + 15) / 16, block = K * 16;
  #pragma omp parallel
  {
    int threads = omp_get_num_threads(), t = omp_get_thread_num();
    int64_t lo = nb_count * t / threads, hi = nb_count * (t + 1) / threads;
    /* tiles of 8 rows x 3 blocks where they pass over the weights fewer times than 6 x 4 ones (7-8, 13-16, 19-24
       rows...); where both take as many passes 6 x 4 reads faster here (a Zen 4 EPYC: 12 and 17 rows ~0.97x) */
    const int many = (M + F32_MR_WIDE - 1) / F32_MR_WIDE < (M + F32_MR_MAX - 1) / F32_MR_MAX;
    const int64_t rows = many ? F32_MR_WIDE : F32_MR_MAX, blocks = many ? 3 : 4;
    for (int64_t nb = lo; nb < hi;) {
      int wide = hi - nb >= blocks;
      const f32_tile_fn* fns = wide ? (many ? F32_TILE3 : F32_TILE4) : F32_TILE1;
      for (int64_t m0 = 0; m0 < M; m0 += rows) {
        int64_t mr = M - m0 < rows ? M - m0 : rows;
        fns[mr](x + m0 * K, K, packed + nb * block, bias ? bias + nb * 16 : 0, y + m0 * N + nb * 16, N,
                N - nb * 16);
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
