/* Quantized-weight GEMM on x86 (AVX2, AVX512-VNNI): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W in GGUF's
   32-weight blocks along K, x and y fp32 or bf16, fp32 sums. Formats (ggml's type ids and definitions):
     Q4_0 (2): fp16 d, 16 bytes of nibbles,          w = d * (q - 8)
     Q4_1 (3): fp16 d, fp16 m, 16 bytes of nibbles,  w = d * q + m
     Q8_0 (8): fp16 d, 32 int8,                      w = d * q
   (nibbles: byte j holds element j in its low half and element j + 16 in its high half).

   The math is llama.cpp's: each row of x is quantized per 32-block to int8 (an fp32 scale dx = amax / 127, codes
   round(x * 127 / amax), their sum sx), and a block's dot product is an exact int32 sum of code products, so
     Q8_0, Q4_0: y += (dw * dx) * sum(q_w * q_x)              (Q4_0's q_w - 8 and Q8_0's q_w exact in the ints)
     Q4_1:       y += (dw * dx) * sum(q_w * q_x) + mw * (dx * sx)
   block after block in K order, each step one fused multiply-add on an fp32 accumulator, then + bias and one
   rounding to y's dtype. The weight is never dequantized to memory: its codes go from the packed layout straight
   into integer dot products.

   Layout (specpd_gemm_q_pack, once at load): output columns in groups of 16, each group's blocks one contiguous
   stream in K order: codes [G][K/32][512 (Q8_0) | 256 (Q4)] bytes, then scales [G][K/32][16 d (+ 16 m)] fp16, the
   file's bytes and no more. Within a block the codes are [8 quads of 4 inputs][16 columns][4 bytes]: one 64-byte
   vector holds 4 consecutive inputs of all 16 columns, so a dot-product instruction multiplies it by one 4-byte
   broadcast of x and adds into the 16 columns' int32 sums, with no horizontal reduction. Q4 keeps two quads per
   byte (quad i low, quad i + 4 high: exactly GGUF's nibble pairs, so packing a Q4 block is a 4-byte transpose);
   Q8_0 stores q + 128 (unsigned, as vpdpbusd wants it; the x side subtracts 128 * sx).

   Tiles: one column group by up to QG_MR rows; a block's codes are unpacked once into registers and serve every
   row of the tile, so 8 rows read the weight once. Threads (OpenMP, torch's pool: specpd/kernels/build.py): x's
   rows quantized split between them, then each a contiguous range of column groups.

   Batch invariance and ISA invariance by construction: a row's quantization, its integer sums (exact) and its
   chain of fp32 operations are the same whatever M, the tile, the thread split or the ISA path (the AVX2 path
   reaches the same integers with vpmaddubsw), so a verify row equals the same row decoded alone, bit for bit,
   and an AVX2 box computes what an AVX-512 one does. specpd/kernels/cpu_gemm_q.py has the torch reference.
   Without AVX2 + FMA + F16C the library builds and specpd_gemm_q_available returns 0. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "dtypes.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define QG_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QG_AVX2 1
#include <immintrin.h>
#endif

enum { QG_Q4_0 = 2, QG_Q4_1 = 3, QG_Q8_0 = 8 };  /* ggml's type ids */

static int qg_block_bytes(int fmt) { return fmt == QG_Q4_0 ? 18 : fmt == QG_Q4_1 ? 20 : fmt == QG_Q8_0 ? 34 : 0; }
static int64_t qg_code_bytes(int fmt) { return fmt == QG_Q8_0 ? 512 : 256; }  /* one block of a 16-column group */
static int64_t qg_scale_halves(int fmt) { return fmt == QG_Q4_1 ? 32 : 16; }   /* fp16 scales per block of a group */

/* 2: AVX512-VNNI, 1: AVX2 (vpmaddubsw), 0: not built here */
int specpd_gemm_q_available(void) {
#if defined(QG_VNNI)
  return 2;
#elif defined(QG_AVX2)
  return 1;
#else
  return 0;
#endif
}

int64_t specpd_gemm_q_packed_bytes(int fmt, int64_t N, int64_t K) {
  if (!qg_block_bytes(fmt) || N <= 0 || K <= 0 || K % 32) return -1;
  return (N + 15) / 16 * (K / 32) * (qg_code_bytes(fmt) + 2 * qg_scale_halves(fmt));
}

/* blocks [N][K/32][block bytes] (a GGUF tensor's rows) -> packed (the header's layout), zero columns past N */
int specpd_gemm_q_pack(int fmt, const uint8_t* blocks, int64_t N, int64_t K, uint8_t* packed) {
  if (specpd_gemm_q_packed_bytes(fmt, N, K) < 0) return 1;
  const int64_t nb = K / 32, groups = (N + 15) / 16, bb = qg_block_bytes(fmt), cb = qg_code_bytes(fmt);
  const int64_t sh = qg_scale_halves(fmt), qs_at = fmt == QG_Q4_1 ? 4 : 2;
  uint16_t* scales = (uint16_t*)(packed + groups * nb * cb);
  #pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; g++)
    for (int64_t b = 0; b < nb; b++) {
      uint8_t* codes = packed + (g * nb + b) * cb;
      uint16_t* sc = scales + (g * nb + b) * sh;
      for (int c = 0; c < 16; c++) {
        const int64_t n = g * 16 + c;
        const uint8_t* blk = n < N ? blocks + (n * nb + b) * bb : NULL;
        uint16_t d = 0, m = 0;
        if (blk) memcpy(&d, blk, 2);
        if (blk && fmt == QG_Q4_1) memcpy(&m, blk + 2, 2);
        sc[c] = d;
        if (fmt == QG_Q4_1) sc[16 + c] = m;
        for (int i = 0; i < (fmt == QG_Q8_0 ? 8 : 4); i++)
          for (int j = 0; j < 4; j++)
            codes[i * 64 + c * 4 + j] = fmt == QG_Q8_0 ? (uint8_t)((blk ? blk[qs_at + 4 * i + j] : 0) ^ 0x80)
                                                       : (blk ? blk[qs_at + 4 * i + j] : 0);
      }
    }
  return 0;
}

/* pack's inverse: packed -> blocks [N][K/32][block bytes] */
int specpd_gemm_q_unpack(int fmt, const uint8_t* packed, int64_t N, int64_t K, uint8_t* blocks) {
  if (specpd_gemm_q_packed_bytes(fmt, N, K) < 0) return 1;
  const int64_t nb = K / 32, groups = (N + 15) / 16, bb = qg_block_bytes(fmt), cb = qg_code_bytes(fmt);
  const int64_t sh = qg_scale_halves(fmt), qs_at = fmt == QG_Q4_1 ? 4 : 2;
  const uint16_t* scales = (const uint16_t*)(packed + groups * nb * cb);
  for (int64_t n = 0; n < N; n++)
    for (int64_t b = 0; b < nb; b++) {
      const int64_t g = n / 16, c = n % 16;
      const uint8_t* codes = packed + (g * nb + b) * cb;
      const uint16_t* sc = scales + (g * nb + b) * sh;
      uint8_t* blk = blocks + (n * nb + b) * bb;
      memcpy(blk, &sc[c], 2);
      if (fmt == QG_Q4_1) memcpy(blk + 2, &sc[16 + c], 2);
      for (int i = 0; i < (fmt == QG_Q8_0 ? 8 : 4); i++)
        for (int j = 0; j < 4; j++)
          blk[qs_at + 4 * i + j] = fmt == QG_Q8_0 ? (uint8_t)(codes[i * 64 + c * 4 + j] ^ 0x80) : codes[i * 64 + c * 4 + j];
    }
  return 0;
}

#if defined(QG_VNNI) || defined(QG_AVX2)
/* x's rows quantized per 32-block, block-major (a tile finds its rows' block b side by side, one base pointer
   each): codes q [K/32][M][32], scale d [K/32][M], code sum s [K/32][M], d * s [K/32][M] */
typedef struct {
  int8_t* q;
  float* d;
  int32_t* s;
  float* ds;
  int64_t M, nb;
} qg_x;

static inline int32_t qg_i32(const int8_t* p) { int32_t v; memcpy(&v, p, 4); return v; }

/* One block's scale and codes from its 32 fp32 values (the reference: cpu_gemm_q.quantize_rows_ref). */
static inline void qg_block_scale(float amax, float* d, float* id) {
  *d = amax / 127.0f;
  *id = amax > 0.0f ? 127.0f / amax : 0.0f;
}
#endif

#ifdef QG_VNNI
#define QG_MR 16  /* rows a tile takes: 8 code vectors + 16 accumulators + scales fit the 32 registers */

static inline __m512 qg_load16(int dt, const void* x, int64_t i) {
  if (dt == 0) return _mm512_loadu_ps((const float*)x + i);
  __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)x + i));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static void qg_quantize_row(int dt, const void* x, const qg_x* X, int64_t row) {
  for (int64_t b = 0; b < X->nb; b++) {
    int8_t* q = X->q + (b * X->M + row) * 32;
    __m512 v0 = qg_load16(dt, x, 32 * b), v1 = qg_load16(dt, x, 32 * b + 16);
    float d, id;
    qg_block_scale(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1))), &d, &id);
    const __m512 idv = _mm512_set1_ps(id);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    __m512i q0 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, idv)), lo), hi);
    __m512i q1 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, idv)), lo), hi);
    _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(q1));
    const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    X->d[b * X->M + row] = d;
    X->s[b * X->M + row] = s;
    X->ds[b * X->M + row] = d * (float)s;
  }
}

/* MR rows (m0..) x one column group over every block; out: [MR][16] fp32 sums */
static inline __attribute__((always_inline)) void qg_tile(const int fmt, const int MR, const uint8_t* codes,
                                                          const uint16_t* sc, const qg_x* X, int64_t m0,
                                                          float* out) {
  const int64_t nb = X->nb, M = X->M, cb = qg_code_bytes(fmt), sh = qg_scale_halves(fmt);
  const int off = fmt == QG_Q8_0 ? 128 : fmt == QG_Q4_0 ? 8 : 0;  /* the unsigned codes' offset */
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* cw = codes + b * cb;
    __m512i w[8];
    if (fmt == QG_Q8_0) {
#pragma GCC unroll 8
      for (int i = 0; i < 8; i++) w[i] = _mm512_loadu_si512(cw + 64 * i);
    } else {
#pragma GCC unroll 4
      for (int i = 0; i < 4; i++) {
        __m512i v = _mm512_loadu_si512(cw + 64 * i);
        w[i] = _mm512_and_si512(v, low4);
        w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + b * sh)));
    __m512 mw = _mm512_setzero_ps();
    if (fmt == QG_Q4_1) mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + b * sh + 16)));
    const int64_t at = b * M + m0;  /* the tile's first row in block b */
    const int8_t* xq = X->q + at * 32;
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++) {
      /* the codes' offset taken off up front: the int32 sum starts at -offset * sum(q_x) */
      __m512i s = off ? _mm512_set1_epi32(-off * X->s[at + r]) : _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int i = 0; i < 8; i++) s = _mm512_dpbusd_epi32(s, w[i], _mm512_set1_epi32(qg_i32(xq + 32 * r + 4 * i)));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(X->d[at + r])), _mm512_cvtepi32_ps(s), acc[r]);
      if (fmt == QG_Q4_1) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(X->ds[at + r]), acc[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

/* rows [m0, m0 + mr) of one group's sums + bias -> y (columns n0.., `cols` of them), rounded to y's dtype */
static void qg_store(int dt, const float* out, int mr, const float* bias, void* y, int64_t ldy, int64_t m0,
                     int64_t n0, int64_t cols) {
  const __mmask16 mask = cols >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < mr; r++) {
    __m512 v = _mm512_add_ps(_mm512_loadu_ps(out + 16 * r), bv);
    const int64_t at = (m0 + r) * ldy + n0;
    if (dt == 0) {
      _mm512_mask_storeu_ps((float*)y + at, mask, v);
    } else {  /* round to nearest even as torch (dtypes.h's f32_bf16), NaN stays NaN */
      __m512i u = _mm512_castps_si512(v);
      __m512i rounded = _mm512_srli_epi32(
          _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                               _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)))), 16);
      __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                             _mm512_set1_epi32(0x7f800000));
      rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
      _mm256_mask_storeu_epi16((uint16_t*)y + at, mask, _mm512_cvtepi32_epi16(rounded));
    }
  }
}
#endif

#ifdef QG_AVX2
#define QG_MR 8  /* rows a tile takes (its 8 code vectors fill half the 16 registers: the sums spill to L1) */

static inline __m256 qg_load8(int dt, const void* x, int64_t i) {
  if (dt == 0) return _mm256_loadu_ps((const float*)x + i);
  __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)x + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float qg_hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

static inline int32_t qg_hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

static void qg_quantize_row(int dt, const void* x, const qg_x* X, int64_t row) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  for (int64_t b = 0; b < X->nb; b++) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
      v[i] = qg_load8(dt, x, 32 * b + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], absmask));
    }
    float d, id;
    qg_block_scale(qg_hmax(amax), &d, &id);
    __m256i qi[4];
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
      qi[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id))), lo), hi);
      sum = _mm256_add_epi32(sum, qi[i]);
    }
    /* 32 int32 -> 32 int8 in order (packs work per 128-bit lane: the permute puts the lanes back) */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)(X->q + (b * X->M + row) * 32), p);
    const int32_t s = qg_hsum(sum);
    X->d[b * X->M + row] = d;
    X->s[b * X->M + row] = s;
    X->ds[b * X->M + row] = d * (float)s;
  }
}

/* MR rows x one column group, as two halves of 8 columns; out: [MR][16] fp32 sums */
static inline __attribute__((always_inline)) void qg_tile(const int fmt, const int MR, const uint8_t* codes,
                                                          const uint16_t* sc, const qg_x* X, int64_t m0,
                                                          float* out) {
  const int64_t nb = X->nb, M = X->M, cb = qg_code_bytes(fmt), sh = qg_scale_halves(fmt);
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
  for (int h = 0; h < 2; h++) {
    __m256 acc[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t* cw = codes + b * cb + 32 * h;
      __m256i w[8];
      if (fmt == QG_Q8_0) {  /* signed weights back (q + 128 -> q) */
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) w[i] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(cw + 64 * i)), flip);
      } else {
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
          __m256i v = _mm256_loadu_si256((const __m256i*)(cw + 64 * i));
          w[i] = _mm256_and_si256(v, low4);
          w[i + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
      }
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc + b * sh + 8 * h)));
      __m256 mw = _mm256_setzero_ps();
      if (fmt == QG_Q4_1) mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc + b * sh + 16 + 8 * h)));
      const int64_t row0 = b * M + m0;  /* the tile's first row in block b */
#pragma GCC unroll 8
      for (int r = 0; r < MR; r++) {
        const int64_t at = row0 + r;
        const int8_t* xr = X->q + at * 32;
        __m256i s;
        if (fmt == QG_Q8_0) {
          /* |w| (unsigned, <= 128) times x with w's sign: a pair of products stays within int16 */
          s = _mm256_setzero_si256();
#pragma GCC unroll 8
          for (int i = 0; i < 8; i++) {
            __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w[i]),
                                             _mm256_sign_epi8(_mm256_set1_epi32(qg_i32(xr + 4 * i)), w[i]));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
          }
        } else {
          /* nibble x code pairs are at most 2 * 15 * 127: the 8 quads' int16 sums cannot overflow */
          __m256i s16 = _mm256_setzero_si256();
#pragma GCC unroll 8
          for (int i = 0; i < 8; i++)
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[i], _mm256_set1_epi32(qg_i32(xr + 4 * i))));
          s = _mm256_madd_epi16(s16, ones);
          if (fmt == QG_Q4_0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * X->s[at]));
        }
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(X->d[at])), _mm256_cvtepi32_ps(s), acc[r]);
        if (fmt == QG_Q4_1) acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(X->ds[at]), acc[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) _mm256_storeu_ps(out + 16 * r + 8 * h, acc[r]);
  }
}

static void qg_store(int dt, const float* out, int mr, const float* bias, void* y, int64_t ldy, int64_t m0,
                     int64_t n0, int64_t cols) {
  for (int r = 0; r < mr; r++) {
    float v[16];
    for (int c = 0; c < 16; c++) v[c] = out[16 * r + c] + (bias && c < cols ? bias[n0 + c] : 0.0f);
    store(y, dt, (m0 + r) * ldy + n0, cols < 16 ? cols : 16, v);
  }
}
#endif

#if defined(QG_VNNI) || defined(QG_AVX2)
typedef void (*qg_tile_fn)(const uint8_t*, const uint16_t*, const qg_x*, int64_t, float*);
#define QG_TILE(F, MR) \
  static void qg_tile_##F##_##MR(const uint8_t* c, const uint16_t* s, const qg_x* X, int64_t m0, float* o) { \
    qg_tile(F, MR, c, s, X, m0, o); \
  }
/* instantiated for MR = 1..QG_MR, by format */
#define QG_TILES4(F) QG_TILE(F, 1) QG_TILE(F, 2) QG_TILE(F, 3) QG_TILE(F, 4)
#define QG_LIST4(F) qg_tile_##F##_1, qg_tile_##F##_2, qg_tile_##F##_3, qg_tile_##F##_4
#if QG_MR == 16
#define QG_FORMAT(F)                                                                                            \
  QG_TILES4(F) QG_TILE(F, 5) QG_TILE(F, 6) QG_TILE(F, 7) QG_TILE(F, 8) QG_TILE(F, 9) QG_TILE(F, 10)             \
  QG_TILE(F, 11) QG_TILE(F, 12) QG_TILE(F, 13) QG_TILE(F, 14) QG_TILE(F, 15) QG_TILE(F, 16)                      \
  static const qg_tile_fn QG_TILES_##F[17] = {0, QG_LIST4(F), qg_tile_##F##_5, qg_tile_##F##_6,                 \
      qg_tile_##F##_7, qg_tile_##F##_8, qg_tile_##F##_9, qg_tile_##F##_10, qg_tile_##F##_11, qg_tile_##F##_12,  \
      qg_tile_##F##_13, qg_tile_##F##_14, qg_tile_##F##_15, qg_tile_##F##_16};
#else
#define QG_FORMAT(F)                                                                                            \
  QG_TILES4(F) QG_TILE(F, 5) QG_TILE(F, 6) QG_TILE(F, 7) QG_TILE(F, 8)                                          \
  static const qg_tile_fn QG_TILES_##F[9] = {0, QG_LIST4(F), qg_tile_##F##_5, qg_tile_##F##_6, qg_tile_##F##_7, \
                                             qg_tile_##F##_8};
#endif
QG_FORMAT(2)
QG_FORMAT(3)
QG_FORMAT(8)

static const qg_tile_fn* qg_tiles(int fmt) { return fmt == QG_Q4_0 ? QG_TILES_2 : fmt == QG_Q4_1 ? QG_TILES_3 : QG_TILES_8; }

/* a per-thread scratch for x's quantized rows, grown as needed (one per calling thread: concurrent callers in
   one process never share it) */
static __thread uint8_t* qg_ws = NULL;
static __thread size_t qg_ws_bytes = 0;

static uint8_t* qg_workspace(size_t bytes) {
  if (bytes > qg_ws_bytes) {
    free(qg_ws);
    qg_ws_bytes = (bytes + 4095) & ~(size_t)4095;
    qg_ws = aligned_alloc(64, qg_ws_bytes);
    if (!qg_ws) qg_ws_bytes = 0;
  }
  return qg_ws;
}
#endif

/* x [M, K] fp32 (dt 0) or bf16 (dt 1), rows ldx elements apart; packed from specpd_gemm_q_pack; bias [N] fp32 or
   NULL; y [M, N] in x's dtype. Returns 0, or 1 (bad format / K), 2 (not built here), 3 (bad dtype), 4 (no memory). */
int specpd_gemm_q(int fmt, int dt, const void* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* packed,
                  const float* bias, int64_t N, void* y) {
  if (specpd_gemm_q_packed_bytes(fmt, N, K) < 0) return 1;
#if defined(QG_VNNI) || defined(QG_AVX2)
  if (dt != 0 && dt != 1) return 3;
  if (M <= 0) return 0;
  const int64_t nb = K / 32, groups = (N + 15) / 16, cb = qg_code_bytes(fmt), sh = qg_scale_halves(fmt);
  const size_t qbytes = ((size_t)(M * K) + 63) & ~(size_t)63, sbytes = ((size_t)(M * nb) * 4 + 63) & ~(size_t)63;
  uint8_t* ws = qg_workspace(qbytes + 3 * sbytes);
  if (!ws) return 4;
  const qg_x X = {(int8_t*)ws, (float*)(ws + qbytes), (int32_t*)(ws + qbytes + sbytes),
                  (float*)(ws + qbytes + 2 * sbytes), M, nb};
  const uint16_t* scales = (const uint16_t*)(packed + groups * nb * cb);
  const qg_tile_fn* tiles = qg_tiles(fmt);
  const int64_t es = dt == 0 ? 4 : 2;
  #pragma omp parallel
  {
    const int threads = omp_get_num_threads(), t = omp_get_thread_num();
    for (int64_t m = M * t / threads; m < M * (t + 1) / threads; m++)
      qg_quantize_row(dt, (const char*)x + m * ldx * es, &X, m);
    #pragma omp barrier
    float out[QG_MR * 16] __attribute__((aligned(64)));
    for (int64_t g = groups * t / threads; g < groups * (t + 1) / threads; g++) {
      const uint8_t* gc = packed + g * nb * cb;
      const uint16_t* gs = scales + g * nb * sh;
      for (int64_t m0 = 0; m0 < M; m0 += QG_MR) {
        const int mr = M - m0 < QG_MR ? (int)(M - m0) : QG_MR;
        tiles[mr](gc, gs, &X, m0, out);
        qg_store(dt, out, mr, bias, y, N, m0, 16 * g, N - 16 * g);
      }
    }
  }
  return 0;
#else
  (void)dt; (void)x; (void)ldx; (void)M; (void)packed; (void)bias; (void)y;
  return 2;
#endif
}
