/* Paged attention for CPU: one call per layer writes the step's new K/V into the paged pool (RoPE applied to
   K) and attends every query row (RoPE applied to Q) over its sequence's pages, with a causal or a tree mask.
   See specpd/kernels/cpu_attention.py for the contract; the torch reference is specpd.attention.reference.fused_attention_ref.

   Per work item (sequence b, kv head h, a block of up to RB query rows): the block's G = Hq / Hkv query
   heads share every K/V load (GQA). Keys come in chunks of CH positions at absolute offsets 0, CH, 2 CH ...,
   loaded once per chunk (K as fp32 rows, or transposed to [D][CH] for many query vectors: the same scores bit
   for bit; V [CH][D] fp32) and used by every row of the block;
   each row keeps an online softmax (max m, sum l, acc[D]). A masked key contributes exactly nothing and a
   chunk fully masked for a row is skipped, so a row's result does not depend on which rows share its block:
   a verify row equals the decode step over the same prefix, bit for bit.

   bf16 on AMX (specpd_attention_use_amx; see attn_use_amx): the same chunks and the same online softmax, with
   the scores and P.V as tile products. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define ATTN_AMX 1
#include "amx.h"
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define ATTN_DP 1
#endif

#define CH 16
#define RB 16
#define DMAX 256
#define GMAX 16
#define ROW_PATH_VECTORS 8  /* a chunk's scores from K rows up to this many query vectors, else transposed K */
#define NV 4  /* query vectors sharing each K / V load (AVX-512 path) */

#include "dtypes.h"

/* Neox RoPE in place: x * cos + swap_halves(x) * signed_sin (the tables' sin has its first half negated) */
static inline void rope(float* restrict x, const float* restrict c, const float* restrict s, int64_t D) {
  float t[DMAX];
  int64_t half = D / 2;
  for (int64_t d = 0; d < half; d++) { t[d] = x[d + half]; t[d + half] = x[d]; }
  for (int64_t d = 0; d < D; d++) x[d] = x[d] * c[d] + t[d] * s[d];
}

/* exp for x <= 0 (and -inf), ~1 ulp, vectorisable: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2] */
static inline float exp_neg(float x) {
  x = x < -87.0f ? -87.0f : x;
  float n = __builtin_roundf(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f; p = p * r + 8.3334519073e-3f; p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f; p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t e = ((int32_t)n + 127) << 23;
  float scale; memcpy(&scale, &e, 4);
  return p * scale;
}

#ifdef __AVX512F__
/* 16 values of dtype dt at base + off as fp32 */
static inline __m512 load16(const void* base, int dt, int64_t off) {
  if (dt == 0) return _mm512_loadu_ps((const float*)base + off);
  __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)base + off));
  if (dt == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

/* exp(x) for x in [-87, 0], the same polynomial as exp_neg, 16 lanes */
static inline __m512 exp16(__m512 x) {
  const __m512 nn = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(nn, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(nn, _mm512_set1_ps(0.693359375f), x));
  __m512 q = _mm512_set1_ps(1.9875691500e-4f);
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.3981999507e-3f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(8.3334519073e-3f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(4.1665795894e-2f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.6666665459e-1f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(5.0000001201e-1f));
  q = _mm512_fmadd_ps(_mm512_mul_ps(q, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(q, nn);
}

/* r[i] = row i of a 16 x 16 block -> r[i] = column i (checked against a scalar transpose in development) */
static inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) { t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]); t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]); }
  for (int i = 0; i < 16; i += 4) {
    r[i]     = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]),     _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]),     _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int i = 0; i < 4; i++) {
    t[i]      = _mm512_shuffle_f32x4(r[i],     r[i + 4],  0x88);
    t[i + 4]  = _mm512_shuffle_f32x4(r[i],     r[i + 4],  0xdd);
    t[i + 8]  = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; i++) {
    r[i]     = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}
#endif

#ifdef __AVX512F__
/* 32 bf16 values at p widened to fp32 without shuffles: a shift gives the even elements (lane i: element 2i),
   a mask the odd ones (lane i: element 2i + 1) */
static inline __m512 bf16_even16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16));
}
static inline __m512 bf16_odd16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* Row j of the chunk's V as DD / 16 fp32 vectors. bf16: vector 2h holds the even elements of [32h, 32h + 32),
   vector 2h + 1 the odd ones, so a bf16 accumulator holds its dims in that order (attend_block's final store
   puts them back). */
static inline void load_v(const void* pool, int dt, int64_t off, int64_t DD, __m512* vr) {
  if (dt == 1) {
    for (int64_t h = 0; h < DD / 32; h++) {
      vr[2 * h] = bf16_even16((const uint16_t*)pool + off + 32 * h);
      vr[2 * h + 1] = bf16_odd16((const uint16_t*)pool + off + 32 * h);
    }
  } else {
    for (int64_t b = 0; b < DD / 16; b++) vr[b] = load16(pool, dt, off + 16 * b);
  }
}

/* The 16 horizontal sums of t[0..16) as one vector (lane j: the sum of t[j]'s lanes), in a fixed order: pairs
   within 128-bit lanes, then the four 128-bit lanes ((L0 + L2) + (L1 + L3)). */
static inline __m512 hsum16(const __m512 t[16]) {
  __m512 a[8], b[4];
  for (int k = 0; k < 8; k++)
    a[k] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * k], t[2 * k + 1]), _mm512_unpackhi_ps(t[2 * k], t[2 * k + 1]));
  for (int k = 0; k < 4; k++) {
    const __m512d x = _mm512_castps_pd(a[2 * k]), y = _mm512_castps_pd(a[2 * k + 1]);
    b[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  /* b[k]'s 128-bit lane L: keys 4k .. 4k + 3 summed over lane L's four elements; sum the lanes */
  const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x44), _mm512_shuffle_f32x4(b[0], b[1], 0xEE));
  const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x44), _mm512_shuffle_f32x4(b[2], b[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xDD));
}

/* One chunk of CH = 16 keys for the active query vectors act[0..nact) (D a compile-time constant: 64 or 128).
   NV vectors at a time. Scores, one of two ways with the same result bit for bit (the queries' dims and K's in
   load_v's order): `KR` (a block of few vectors: a decode row's G): per vector, each key's row (DD / 16 fp32
   vectors) multiplied into one vector, the 16 of them summed horizontally (hsum16), with no transpose of K
   (transposing was a third of a decode chunk's instructions, and its scores one 64-deep FMA chain per vector);
   else `KT` (the keys transposed once for many vectors: a verify block, a prefill chunk): per vector, 16 lane
   partials (lane j: key j; partial i lane j is the K-row path's t[j] lane i, the same operations) summed in
   hsum16's order. Then NV online-softmax updates; then P.V with each key's V row loaded once for all NV vectors
   and their accumulators in registers. A vector's arithmetic is the same whatever shares its group (and whatever
   NV is), so a row's result does not depend on the rows beside it. `full`: every key of the chunk is visible to
   every row (vis would add 0, keep multiply by 1: skipped, the same result). */
#define CHUNK_KERNEL(NAME, DD, NVV)                                                                            \
static void NAME(const float (*Q)[DD], const float (*KR)[DD], const float (*KT)[CH], const void* pool, int dt,    \
                 const int64_t* voff,                                                                            \
                 const float (*vis)[CH], const float (*keep)[CH], int full, const int64_t* act, int64_t nact,      \
                 int64_t n, int64_t G, float* m, float* l, float (*acc)[DD]) {                                   \
  for (int64_t k0 = 0; k0 < nact; k0 += NVV) {                                                                  \
    const int64_t nv = nact - k0 < NVV ? nact - k0 : NVV;                                                        \
    int64_t vv[NVV];                                                                                            \
    for (int u = 0; u < NVV; u++) vv[u] = act[k0 + (u < nv ? u : 0)];                                           \
    __m512 sc[NVV];                                                                                             \
    if (KR) {                                                                                                   \
      for (int u = 0; u < NVV; u++) {                                                                           \
        __m512 qz[DD / 16], t[CH];                                                                              \
        for (int b = 0; b < DD / 16; b++) qz[b] = _mm512_load_ps(Q[vv[u]] + 16 * b);                            \
        for (int j = 0; j < CH; j++) {                                                                          \
          __m512 x = _mm512_mul_ps(qz[0], _mm512_load_ps(KR[j]));                                               \
          for (int b = 1; b < DD / 16; b++) x = _mm512_fmadd_ps(qz[b], _mm512_load_ps(KR[j] + 16 * b), x);      \
          t[j] = x;                                                                                             \
        }                                                                                                       \
        sc[u] = hsum16(t);                                                                                      \
      }                                                                                                         \
    } else { /* hsum16's order, four partials at a time, each KT row loaded once for the NV vectors */          \
      __m512 S[NVV][4];                                                                                         \
      for (int L = 0; L < 4; L++) {                                                                             \
        __m512 x[NVV][4];                                                                                       \
        for (int ii = 0; ii < 4; ii++) {                                                                        \
          const int i = 4 * L + ii;                                                                             \
          const __m512 k0 = _mm512_load_ps(KT[i]);                                                              \
          for (int u = 0; u < NVV; u++) x[u][ii] = _mm512_mul_ps(_mm512_set1_ps(Q[vv[u]][i]), k0);              \
          for (int b = 1; b < DD / 16; b++) {                                                                   \
            const __m512 kb = _mm512_load_ps(KT[16 * b + i]);                                                   \
            for (int u = 0; u < NVV; u++)                                                                       \
              x[u][ii] = _mm512_fmadd_ps(_mm512_set1_ps(Q[vv[u]][16 * b + i]), kb, x[u][ii]);                   \
          }                                                                                                     \
        }                                                                                                       \
        for (int u = 0; u < NVV; u++)                                                                           \
          S[u][L] = _mm512_add_ps(_mm512_add_ps(x[u][0], x[u][2]), _mm512_add_ps(x[u][1], x[u][3]));            \
      }                                                                                                         \
      for (int u = 0; u < NVV; u++)                                                                             \
        sc[u] = _mm512_add_ps(_mm512_add_ps(S[u][0], S[u][2]), _mm512_add_ps(S[u][1], S[u][3]));                \
    }                                                                                                           \
    float pr[NVV][CH] __attribute__((aligned(64)));                                                             \
    float alpha[NVV];                                                                                           \
    for (int u = 0; u < NVV; u++) {                                                                             \
      const int64_t v = vv[u], i = v / G;                                                                       \
      __m512 x = full ? sc[u] : _mm512_add_ps(sc[u], _mm512_loadu_ps(vis[i]));                                   \
      const float mx = _mm512_reduce_max_ps(x);                                                                 \
      const float m_new = mx > m[v] ? mx : m[v];                                                                \
      x = _mm512_max_ps(_mm512_sub_ps(x, _mm512_set1_ps(m_new)), _mm512_set1_ps(-87.0f));                       \
      const __m512 e = full ? exp16(x) : _mm512_mul_ps(exp16(x), _mm512_loadu_ps(keep[i]));                      \
      _mm512_store_ps(pr[u], e);                                                                                \
      alpha[u] = exp_neg(m[v] - m_new); /* m[v] = -inf the first time: 0 */                                     \
      if (u < nv) { l[v] = l[v] * alpha[u] + _mm512_reduce_add_ps(e); m[v] = m_new; }                           \
    }                                                                                                           \
    __m512 o[NVV][DD / 16];                                                                                     \
    for (int u = 0; u < NVV; u++)                                                                               \
      for (int b = 0; b < DD / 16; b++) o[u][b] = _mm512_mul_ps(_mm512_loadu_ps(acc[vv[u]] + 16 * b), _mm512_set1_ps(alpha[u])); \
    for (int64_t j = 0; j < n; j++) {                                                                           \
      __m512 vr[DD / 16];                                                                                       \
      load_v(pool, dt, voff[j], DD, vr);                                                                        \
      for (int u = 0; u < NVV; u++) {                                                                           \
        const __m512 pj = _mm512_set1_ps(pr[u][j]);                                                             \
        for (int b = 0; b < DD / 16; b++) o[u][b] = _mm512_fmadd_ps(pj, vr[b], o[u][b]);                         \
      }                                                                                                         \
    }                                                                                                           \
    for (int u = 0; u < nv; u++) /* padding lanes (repeating the first vector) are never stored */              \
      for (int b = 0; b < DD / 16; b++) _mm512_storeu_ps(acc[vv[u]] + 16 * b, o[u][b]);                         \
  }                                                                                                             \
}
CHUNK_KERNEL(chunk_avx512_d64, 64, 4)
CHUNK_KERNEL(chunk_avx512_d64_nv3, 64, 3)  /* GQA groups of 3 (SmolLM2's 9 / 3 heads): no padding vector */
CHUNK_KERNEL(chunk_avx512_d128, 128, 2)
#endif

#ifdef ATTN_DP
/* interleave two rows of 32 bf16: lo = dims 0..15 of a and b in pairs (a0 b0 a1 b1 ...), hi = dims 16..31 */
static const uint16_t PAIR_LO[32] __attribute__((aligned(64))) = {
  0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const uint16_t PAIR_HI[32] __attribute__((aligned(64))) = {
  16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
#endif

#ifdef ATTN_AMX
/* bf16 attention on AMX tiles (specpd_attention_use_amx; build.attention_amx_wanted). Per chunk of 16 keys and
   group of 16 query vectors (a block's vectors 16g .. 16g + 15): scores S[vector][key] = Q . K over D / 32
   tile products (Q rounded to bf16 after RoPE and the scale; K transposed by pairs of dims), the online softmax
   per vector as the vector path's (fp32, lanes = keys), P rounded to bf16, and P.V in tiles (V interleaved by
   pairs of keys) into a fresh 16 x D block that the accumulators take as acc * alpha + block. Every element of
   a tile product is its own chain over its row of A and column of B, so a vector's scores and output do not
   depend on the vectors sharing its tile: decode rows, verify rows and tree rows run the same path and a
   verify row still equals the decode step bit for bit. One path per process (decode and verify alike): it
   rounds apart from the vector path. */
static int attn_use_amx = 0;

/* Use the AMX tiles when `on` and Linux grants their state; returns whether they are used. */
int specpd_attention_use_amx(int on) {
  attn_use_amx = on && amx_request();
  return attn_use_amx;
}

/* the tiles run_chunk_amx uses (see there); mr: a group's vector rows */
static void attn_amx_configure(int mr) {
  int rows[8], colsb[8];
  for (int t = 0; t < 8; t++) {
    rows[t] = t == 7 ? 8 : t == 5 ? 16 : mr;
    colsb[t] = t == 6 ? 32 : 64;
  }
  amx_load_config(rows, colsb);
}

#else
int specpd_attention_use_amx(int on) {  /* built without AMX (an x86-64-v3 build, an older CPU): never */
  (void)on;
  return 0;
}
#endif

typedef struct {
  int dt;
  const void* q; int64_t q_stride; const int64_t* q_pos;
  const float* cos_t; const float* sin_t;
  void* pool; int64_t page_stride, k_off, v_off, pos_stride, head_stride, ps;
  const int32_t* qo_indptr; const int32_t* kv_lens; const int32_t* page_table; int64_t max_pages;
  const uint8_t* tree; const int32_t* tree_indptr;
  int64_t Hq, Hkv, D; float scale;
  void* out;
} Args;

/* slot offsets (K half, layer 0 of the pool's element index) of positions [c, c + n) of sequence b, kv head
   h, walking its pages (no division per key) */
static inline void chunk_slots(const Args* a, int64_t b, int64_t h, int64_t c, int64_t n, int64_t* offs) {
  int64_t pg = c / a->ps, within = c % a->ps;
  const int32_t* table = a->page_table + b * a->max_pages;
  for (int64_t j = 0; j < n; j++) {
    offs[j] = (int64_t)table[pg] * a->page_stride + within * a->pos_stride + h * a->head_stride;
    if (++within == a->ps) { within = 0; pg++; }
  }
}

/* What one work item's chunks share: its queries (RoPE'd, scaled), online-softmax state and scratch. */
typedef struct {
  const Args* a;
  int64_t D, G;
  int fast, permuted, amx, dp;
  float* Q;    /* [V][D] */
  uint16_t* Qb;  /* [16 ceil(V / 16)][D]: the AMX path's bf16 queries, zero past V ([V][D]: the dp path's) */
  float* acc;  /* [V][D] */
  float* m;
  float* l;
  float* KT;   /* [D][CH] */
  float* Vc;   /* [CH][D] (the generic path's V rows) */
} Block;

#ifdef ATTN_AMX
/* run_chunk on AMX tiles (bf16 pool, D a multiple of 32): see attn_use_amx. Keys past n are zero (finite scores,
   and a masked key's P is exactly 0). Tiles (attn_amx_configure, mr = a group's vector rows): tmm0..3 fp32
   mr x 16 (the scores, then four 16-dim blocks of P.V), tmm4 Q (mr vectors x 32 dims), tmm5 K^T (16 dim pairs x
   16 keys), tmm6 P (mr vectors x 16 keys), tmm7 V (8 key pairs x 16 dims). */
static void run_chunk_amx(const Block* k, const int64_t* offs, int64_t n, const float (*vis)[CH],
                          const float (*keep)[CH], int full, const int64_t* act, int64_t nact) {
  const Args* a = k->a;
  const int64_t D = k->D, G = k->G;
  const uint16_t* pool = (const uint16_t*)a->pool;
  uint16_t* Kt = (uint16_t*)k->KT;  /* [D / 32][16 dim pairs][16 keys][2]: one B tile per 32 dims */
  uint16_t* Vp = Kt + D * CH;       /* [D / 16][8 key pairs][16 dims][2]: one B tile per 16 dims */
  float (*O)[D] = (float (*)[D])k->Vc;  /* a group's P.V, [16][D] */
  float (*acc)[D] = (float (*)[D])k->acc;
  float* m = k->m;
  float* l = k->l;
  for (int64_t d0 = 0; d0 < D; d0 += 32) {  /* a key's 32 dims as 16 dwords (pairs); the transpose moves bits */
    __m512 r[16];
    for (int64_t j = 0; j < CH; j++)
      r[j] = j < n ? _mm512_castsi512_ps(_mm512_loadu_si512(pool + offs[j] + a->k_off + d0)) : _mm512_setzero_ps();
    transpose16(r);
    for (int p = 0; p < 16; p++) _mm512_store_ps((float*)(Kt + d0 * CH + 32 * p), r[p]);
  }
  const __m512i lo = _mm512_load_si512(PAIR_LO), hi = _mm512_load_si512(PAIR_HI);
  for (int64_t p = 0; p < CH / 2; p++)
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      const __m512i x = 2 * p < n ? _mm512_loadu_si512(pool + offs[2 * p] + a->v_off + d0) : _mm512_setzero_si512();
      const __m512i y = 2 * p + 1 < n ? _mm512_loadu_si512(pool + offs[2 * p + 1] + a->v_off + d0)
                                      : _mm512_setzero_si512();
      _mm512_store_si512(Vp + (d0 / 16) * 256 + 32 * p, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_store_si512(Vp + (d0 / 16 + 1) * 256 + 32 * p, _mm512_permutex2var_epi16(x, hi, y));
    }
  float S[16][16] __attribute__((aligned(64)));
  uint16_t P[16][16] __attribute__((aligned(64)));
  float alpha[16];
  for (int64_t i0 = 0; i0 < nact;) {  /* act ascends: the groups of 16 vectors holding an active one, in order */
    const int64_t g = act[i0] / 16;
    int64_t i1 = i0;
    while (i1 < nact && act[i1] / 16 == g) i1++;
    _tile_zero(0);
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      _tile_loadd(4, k->Qb + 16 * g * D + d0, D * 2);
      _tile_loadd(5, Kt + d0 * CH, 64);
      _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, S, 64);
    memset(P, 0, sizeof P);  /* inactive vectors: P = 0 (their outputs are not taken) */
    for (int64_t i = i0; i < i1; i++) {
      const int64_t v = act[i], u = v - 16 * g, row = v / G;
      __m512 x = full ? _mm512_load_ps(S[u]) : _mm512_add_ps(_mm512_load_ps(S[u]), _mm512_loadu_ps(vis[row]));
      const float mx = _mm512_reduce_max_ps(x);
      const float m_new = mx > m[v] ? mx : m[v];
      x = _mm512_max_ps(_mm512_sub_ps(x, _mm512_set1_ps(m_new)), _mm512_set1_ps(-87.0f));
      const __m512 e = full ? exp16(x) : _mm512_mul_ps(exp16(x), _mm512_loadu_ps(keep[row]));
      alpha[u] = exp_neg(m[v] - m_new);  /* m[v] = -inf the first time: 0 */
      l[v] = l[v] * alpha[u] + _mm512_reduce_add_ps(e);
      m[v] = m_new;
      _mm256_store_si256((__m256i*)P[u], (__m256i)_mm512_cvtneps_pbh(e));
    }
    _tile_loadd(6, P, 32);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {  /* four 16-dim blocks at a time (two where 32 dims are left) */
      const int four = D - d0 >= 64;
      _tile_zero(0); _tile_zero(1);
      _tile_loadd(7, Vp + (d0 / 16) * 256, 64);
      _tile_dpbf16ps(0, 6, 7);
      _tile_loadd(7, Vp + (d0 / 16 + 1) * 256, 64);
      _tile_dpbf16ps(1, 6, 7);
      if (four) {
        _tile_zero(2); _tile_zero(3);
        _tile_loadd(7, Vp + (d0 / 16 + 2) * 256, 64);
        _tile_dpbf16ps(2, 6, 7);
        _tile_loadd(7, Vp + (d0 / 16 + 3) * 256, 64);
        _tile_dpbf16ps(3, 6, 7);
      }
      _tile_stored(0, &O[0][d0], D * 4); _tile_stored(1, &O[0][d0 + 16], D * 4);
      if (four) { _tile_stored(2, &O[0][d0 + 32], D * 4); _tile_stored(3, &O[0][d0 + 48], D * 4); }
    }
    for (int64_t i = i0; i < i1; i++) {
      const int64_t v = act[i], u = v - 16 * g;
      const __m512 al = _mm512_set1_ps(alpha[u]);
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(acc[v] + d, _mm512_fmadd_ps(_mm512_loadu_ps(acc[v] + d), al, _mm512_loadu_ps(O[u] + d)));
    }
    i0 = i1;
  }
}
#endif

#ifdef ATTN_DP
/* bf16 attention on vdpbf16ps (AVX512-BF16 without AMX tiles; specpd_attention_use_dp, build.attention_dp_wanted):
   the AMX path's rounding (the rotated, scaled Q and the softmax's P rounded to bf16, every sum in fp32) on
   vector pair dot products, half the vector path's multiply-adds and no widening of K or V. One path per process
   (decode and verify alike): it rounds apart from the vector path. */
static int attn_use_dp = 0;

/* Use the pair-dot path for bf16 pools when `on`; returns whether it is used. */
int specpd_attention_use_dp(int on) {
  attn_use_dp = on != 0;
  return attn_use_dp;
}

/* run_chunk on vdpbf16ps (bf16 pool, D = DD, 64 or 128): see attn_use_dp. Scores: lane i of key j's partial sums
   the dim pairs (32 b + 2 i, 32 b + 2 i + 1) over the blocks b in order (one dot per 32 dims), and the 16 lanes are
   summed in hsum16's order; from the key rows (`KR`: few vectors, a decode row's G) or from the keys transposed by
   dim pairs (`KT`: a verify block, a prefill chunk), the same operations either way, as the vector path's two ways
   are. Keys past n are zero (finite scores; a masked key's P is exactly 0). Then the online softmax as the vector
   path's (fp32, lanes = keys), P rounded to bf16, and P.V as one dot per 16 dims and pair of keys over V
   interleaved by key pairs (the AMX path's layout). A vector's arithmetic does not depend on the vectors beside
   it, so a verify row still equals the decode step bit for bit. */
#define DP_KERNEL(NAME, DD)                                                                                    \
static void NAME(const Block* k, const int64_t* offs, int64_t n, const float (*vis)[CH], const float (*keep)[CH], \
                 int full, const int64_t* act, int64_t nact) {                                                  \
  enum { NB = DD / 32 };                                                                                        \
  const Args* a = k->a;                                                                                         \
  const int64_t G = k->G;                                                                                       \
  const uint16_t* pool = (const uint16_t*)a->pool;                                                              \
  const uint16_t (*Qb)[DD] = (const uint16_t (*)[DD])k->Qb;                                                      \
  float (*acc)[DD] = (float (*)[DD])k->acc;                                                                     \
  float* m = k->m;                                                                                              \
  float* l = k->l;                                                                                              \
  __m512i* Kx = (__m512i*)k->KT;  /* KR: [CH][NB] key rows; KT: [NB][16] dim pairs x 16 keys */                  \
  __m512i* Vp = (__m512i*)k->Vc;  /* [CH / 2][2 NB]: key pair p's dims 16c .. 16c + 15, interleaved by key */      \
  const __m512i zero = _mm512_setzero_si512();                                                                  \
  const int rows = nact <= ROW_PATH_VECTORS;                                                                    \
  if (rows) {                                                                                                   \
    for (int64_t j = 0; j < CH; j++)                                                                            \
      for (int b = 0; b < NB; b++)                                                                              \
        Kx[j * NB + b] = j < n ? _mm512_loadu_si512(pool + offs[j] + a->k_off + 32 * b) : zero;                 \
  } else {                                                                                                      \
    for (int b = 0; b < NB; b++) { /* 16 keys x 16 dim pairs -> 16 dim pairs x 16 keys (the transpose moves bits) */ \
      __m512 r[16];                                                                                             \
      for (int64_t j = 0; j < CH; j++)                                                                          \
        r[j] = _mm512_castsi512_ps(j < n ? _mm512_loadu_si512(pool + offs[j] + a->k_off + 32 * b) : zero);      \
      transpose16(r);                                                                                           \
      for (int i = 0; i < 16; i++) Kx[b * 16 + i] = _mm512_castps_si512(r[i]);                                  \
    }                                                                                                           \
  }                                                                                                             \
  const __m512i lo = _mm512_load_si512(PAIR_LO), hi = _mm512_load_si512(PAIR_HI);                               \
  const int64_t np = (n + 1) / 2;                                                                               \
  for (int64_t p = 0; p < np; p++)                                                                              \
    for (int b = 0; b < NB; b++) {                                                                              \
      const __m512i x = _mm512_loadu_si512(pool + offs[2 * p] + a->v_off + 32 * b);                             \
      const __m512i y = 2 * p + 1 < n ? _mm512_loadu_si512(pool + offs[2 * p + 1] + a->v_off + 32 * b) : zero;  \
      Vp[p * 2 * NB + 2 * b] = _mm512_permutex2var_epi16(x, lo, y);                                             \
      Vp[p * 2 * NB + 2 * b + 1] = _mm512_permutex2var_epi16(x, hi, y);                                         \
    }                                                                                                           \
  for (int64_t u = 0; u < nact; u++) {                                                                          \
    const int64_t v = act[u], i = v / G;                                                                        \
    __m512 sc;                                                                                                  \
    if (rows) {                                                                                                 \
      __m512bh qz[NB];                                                                                          \
      __m512 t[CH];                                                                                             \
      for (int b = 0; b < NB; b++) qz[b] = (__m512bh)_mm512_load_si512(Qb[v] + 32 * b);                          \
      for (int j = 0; j < CH; j++) {                                                                            \
        __m512 x = _mm512_dpbf16_ps(_mm512_setzero_ps(), qz[0], (__m512bh)Kx[j * NB]);                          \
        for (int b = 1; b < NB; b++) x = _mm512_dpbf16_ps(x, qz[b], (__m512bh)Kx[j * NB + b]);                  \
        t[j] = x;                                                                                               \
      }                                                                                                         \
      sc = hsum16(t);                                                                                           \
    } else { /* lane j of x[ii]: lane 4L + ii of key j's partial above; summed in hsum16's order */              \
      const int32_t* qd = (const int32_t*)Qb[v];  /* dword 16 b + i: dims 32 b + 2 i and 32 b + 2 i + 1 */       \
      __m512 S[4];                                                                                              \
      for (int L = 0; L < 4; L++) {                                                                             \
        __m512 x[4];                                                                                            \
        for (int ii = 0; ii < 4; ii++) {                                                                        \
          const int i2 = 4 * L + ii;                                                                            \
          x[ii] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_set1_epi32(qd[i2]), (__m512bh)Kx[i2]);  \
          for (int b = 1; b < NB; b++)                                                                          \
            x[ii] = _mm512_dpbf16_ps(x[ii], (__m512bh)_mm512_set1_epi32(qd[16 * b + i2]), (__m512bh)Kx[b * 16 + i2]); \
        }                                                                                                       \
        S[L] = _mm512_add_ps(_mm512_add_ps(x[0], x[2]), _mm512_add_ps(x[1], x[3]));                            \
      }                                                                                                         \
      sc = _mm512_add_ps(_mm512_add_ps(S[0], S[2]), _mm512_add_ps(S[1], S[3]));                                 \
    }                                                                                                           \
    __m512 x = full ? sc : _mm512_add_ps(sc, _mm512_loadu_ps(vis[i]));                                          \
    const float mx = _mm512_reduce_max_ps(x);                                                                   \
    const float m_new = mx > m[v] ? mx : m[v];                                                                  \
    x = _mm512_max_ps(_mm512_sub_ps(x, _mm512_set1_ps(m_new)), _mm512_set1_ps(-87.0f));                         \
    const __m512 e = full ? exp16(x) : _mm512_mul_ps(exp16(x), _mm512_loadu_ps(keep[i]));                        \
    const float alpha = exp_neg(m[v] - m_new); /* m[v] = -inf the first time: 0 */                              \
    l[v] = l[v] * alpha + _mm512_reduce_add_ps(e);                                                              \
    m[v] = m_new;                                                                                               \
    int32_t pp[CH / 2] __attribute__((aligned(32)));  /* dword p: P of keys 2p (low half) and 2p + 1, in bf16 */ \
    _mm256_store_si256((__m256i*)pp, (__m256i)_mm512_cvtneps_pbh(e));                                           \
    __m512 o[2 * NB];                                                                                           \
    const __m512 al = _mm512_set1_ps(alpha);                                                                    \
    for (int c = 0; c < 2 * NB; c++) o[c] = _mm512_mul_ps(_mm512_loadu_ps(acc[v] + 16 * c), al);               \
    for (int64_t p = 0; p < np; p++) {                                                                          \
      const __m512bh pw = (__m512bh)_mm512_set1_epi32(pp[p]);                                                   \
      for (int c = 0; c < 2 * NB; c++) o[c] = _mm512_dpbf16_ps(o[c], pw, (__m512bh)Vp[p * 2 * NB + c]);         \
    }                                                                                                           \
    for (int c = 0; c < 2 * NB; c++) _mm512_storeu_ps(acc[v] + 16 * c, o[c]);                                   \
  }                                                                                                             \
}
DP_KERNEL(run_chunk_dp64, 64)
DP_KERNEL(run_chunk_dp128, 128)
#else
int specpd_attention_use_dp(int on) {  /* built without AVX512-BF16: never */
  (void)on;
  return 0;
}
#endif

/* One chunk of n <= CH keys at element offsets offs[] (K half; V is at + v_off - k_off) for the active query
   vectors act[0..nact): vis / keep per block row (a 0 / -inf score offset and a 1 / 0 probability factor), or
   `full` (every key visible to every active vector, the same result as all-visible masks). */
static void run_chunk(const Block* k, const int64_t* offs, int64_t n, const float (*vis)[CH],
                      const float (*keep)[CH], int full, const int64_t* act, int64_t nact) {
  const Args* a = k->a;
  const int64_t D = k->D, G = k->G;
  float (*KT)[CH] = (float (*)[CH])k->KT;
  float (*Vc)[D] = (float (*)[D])k->Vc;
  float (*Q)[D] = (float (*)[D])k->Q;
  float (*acc)[D] = (float (*)[D])k->acc;
  float* m = k->m;
  float* l = k->l;
  int64_t voff[CH];  /* the fast path's V rows, read in place */
#ifdef ATTN_AMX
  if (k->amx) {
    run_chunk_amx(k, offs, n, vis, keep, full, act, nact);
    return;
  }
#endif
#ifdef ATTN_DP
  if (k->dp) {
    if (D == 64) run_chunk_dp64(k, offs, n, vis, keep, full, act, nact);
    else run_chunk_dp128(k, offs, n, vis, keep, full, act, nact);
    return;
  }
#endif
#if defined(__AVX512F__) && CH == 16
  if (k->fast) {  /* K as rows or transposed (CHUNK_KERNEL), dims in load_v's order; V read in place */
    const float (*KR)[D] = 0;
    if (nact <= ROW_PATH_VECTORS) {
      float (*rows)[D] = (float (*)[D])k->KT;  /* [CH][D], in the transposed path's buffer */
      for (int64_t j = 0; j < n; j++) load_v(a->pool, a->dt, offs[j] + a->k_off, D, (__m512*)rows[j]);
      for (int64_t j = n; j < CH; j++) memset(rows[j], 0, D * sizeof(float));  /* masked lanes: finite scores */
      KR = (const float (*)[D])rows;
    } else if (a->dt == 1) {  /* bf16: 32 dims per load; even dims to KT rows d0 .. d0 + 15, odd to the next 16 */
      for (int64_t d0 = 0; d0 < D; d0 += 32) {
        for (int odd = 0; odd < 2; odd++) {
          __m512 r[16];
          for (int64_t j = 0; j < CH; j++) {
            const uint16_t* p = (const uint16_t*)a->pool + offs[j] + a->k_off + d0;
            r[j] = j >= n ? _mm512_setzero_ps() : odd ? bf16_odd16(p) : bf16_even16(p);
          }
          transpose16(r);
          for (int64_t d = 0; d < 16; d++) _mm512_storeu_ps(KT[d0 + 16 * odd + d], r[d]);
        }
      }
    } else {
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512 r[16];
        for (int64_t j = 0; j < CH; j++) r[j] = j < n ? load16(a->pool, a->dt, offs[j] + a->k_off + d0) : _mm512_setzero_ps();
        transpose16(r);
        for (int64_t d = 0; d < 16; d++) _mm512_storeu_ps(KT[d0 + d], r[d]);
      }
    }
    for (int64_t j = 0; j < n; j++) voff[j] = offs[j] + a->v_off;
    if (D == 128) chunk_avx512_d128(Q, (const float (*)[128])KR, (const float (*)[CH])KT, a->pool, a->dt, voff, vis, keep, full, act, nact, n, G, m, l, acc);
    else if (nact % 3 == 0 && nact % 4 != 0) chunk_avx512_d64_nv3(Q, (const float (*)[64])KR, (const float (*)[CH])KT, a->pool, a->dt, voff, vis, keep, full, act, nact, n, G, m, l, acc);
    else chunk_avx512_d64(Q, (const float (*)[64])KR, (const float (*)[CH])KT, a->pool, a->dt, voff, vis, keep, full, act, nact, n, G, m, l, acc);
    return;
  }
#endif
  for (int64_t j = 0; j < n; j++) {
    float kr[DMAX];
    load(a->pool, a->dt, offs[j] + a->k_off, D, kr);
    for (int64_t d = 0; d < D; d++) KT[d][j] = kr[d];
    load(a->pool, a->dt, offs[j] + a->v_off, D, Vc[j]);
  }
  for (int64_t j = n; j < CH; j++) for (int64_t d = 0; d < D; d++) KT[d][j] = 0.0f;
  for (int64_t j = n; j < CH; j++) for (int64_t d = 0; d < D; d++) Vc[j][d] = 0.0f;
  for (int64_t k0 = 0; k0 < nact; k0++) {
    const int64_t v = act[k0], i = v / G;
    float sc[CH], p[CH], sum = 0.0f;
    for (int64_t j = 0; j < CH; j++) sc[j] = 0.0f;
    for (int64_t d = 0; d < D; d++) {
      const float qd = Q[v][d];
      for (int64_t j = 0; j < CH; j++) sc[j] += qd * KT[d][j];
    }
    float mx = -INFINITY;
    for (int64_t j = 0; j < CH; j++) { sc[j] += full ? 0.0f : vis[i][j]; mx = sc[j] > mx ? sc[j] : mx; }
    const float m_new = mx > m[v] ? mx : m[v];
    for (int64_t j = 0; j < CH; j++) p[j] = exp_neg(sc[j] - m_new) * (full ? 1.0f : keep[i][j]);
    for (int64_t j = 0; j < CH; j++) sum += p[j];
    const float alpha = exp_neg(m[v] - m_new);  /* m[v] = -inf the first time: 0 */
    l[v] = l[v] * alpha + sum;
    m[v] = m_new;
    float* o = acc[v];
    for (int64_t d = 0; d < D; d++) o[d] *= alpha;
    for (int64_t j = 0; j < n; j++) {
      const float pj = p[j];
      for (int64_t d = 0; d < D; d++) o[d] += pj * Vc[j][d];
    }
  }
}

/* one work item: sequence b, kv head h, query rows [r0, r0 + nr) of the sequence.
   Keys are read in chunks of CH positions. Without a tree mask a key's slot is its position. With one, a row's
   visible tree nodes (its ancestors and itself, in index order: one per depth) sit in slots prefix + t that are
   not their positions (a sibling takes the slot), so from the chunk holding `prefix` on each row reads its own
   keys by position: lane j of chunk c is position c + j, which is a prefix slot or the row's ancestor at depth
   c + j - prefix. A tree row then meets its keys in the chunks and lanes a decode row at its position meets them
   (the same sums in the same order), so a verify row equals the decode step over the same prefix bit for bit,
   in bf16 too; reading by slot, a node in a sibling's slot summed its softmax lanes in another order. */
static void attend_block(const Args* a, int64_t b, int64_t h, int64_t r0, int64_t nr, int amx, int* tile_rows) {
  const int64_t D = a->D, G = a->Hq / a->Hkv, V = nr * G;  /* V query vectors: row-major (row, group head) */
  const int64_t q_start = a->qo_indptr[b], q_len = a->qo_indptr[b + 1] - q_start, kv_len = a->kv_lens[b];
  int64_t width = q_len;  /* the tail block of KV positions the mask governs; before it everything is visible */
  const uint8_t* tree = 0;
  if (a->tree && a->tree_indptr[b + 1] > a->tree_indptr[b]) {
    tree = a->tree + a->tree_indptr[b];
    width = (a->tree_indptr[b + 1] - a->tree_indptr[b]) / q_len;
  }
  const int64_t prefix = kv_len - width;
  float Q[V][D] __attribute__((aligned(64)));  /* the block's queries, RoPE'd and scaled */
  float acc[V][D] __attribute__((aligned(64)));
  float m[V], l[V];
  float KT[D][CH] __attribute__((aligned(64)));  /* a chunk's keys, transposed: scores vectorise over keys (AMX:
                                                    its K^T and V tiles, bf16) */
  float Vc[CH][D] __attribute__((aligned(64)));  /* the generic path's fp32 V rows (AMX: a group's P.V) */
#if defined(__AVX512F__) && CH == 16
  const int fast = D == 64 || D == 128;
#else
  const int fast = 0;
#endif
#ifdef ATTN_DP
  const int dp = !amx && attn_use_dp && a->dt == 1 && fast;
#else
  const int dp = 0;
#endif
  const int64_t Vpad = amx ? (V + 15) / 16 * 16 : dp ? V : 1;
  uint16_t Qb[Vpad][D] __attribute__((aligned(64)));
  const Block k = {a, D, G, fast, fast && a->dt == 1 && !amx && !dp, amx, dp, &Q[0][0], &Qb[0][0], &acc[0][0], m,
                   l, &KT[0][0], &Vc[0][0]};
  int64_t last = 0;  /* one past the last position any row of the block sees */
  for (int64_t i = 0; i < nr; i++) {
    int64_t row = r0 + i, t = q_start + row;
    for (int64_t g = 0; g < G; g++) {
      float* x = Q[i * G + g];
      load(a->q, a->dt, t * a->q_stride + (h * G + g) * D, D, x);
      if (a->cos_t) rope(x, a->cos_t + a->q_pos[t] * D, a->sin_t + a->q_pos[t] * D, D);
      for (int64_t d = 0; d < D; d++) { x[d] *= a->scale; acc[i * G + g][d] = 0.0f; }
      if (k.permuted) {  /* the dims in load_v's bf16 order (32h + 2i, then 32h + 2i + 1), as the K rows come */
        float t[DMAX];
        memcpy(t, x, D * sizeof(float));
        for (int64_t h0 = 0; h0 < D; h0 += 32)
          for (int64_t i2 = 0; i2 < 16; i2++) { x[h0 + i2] = t[h0 + 2 * i2]; x[h0 + 16 + i2] = t[h0 + 2 * i2 + 1]; }
      }
      m[i * G + g] = -INFINITY; l[i * G + g] = 0.0f;
    }
    int64_t end = tree ? kv_len : prefix + row + 1;
    if (end > last) last = end;
  }
  if (amx || dp)  /* the bf16 paths' queries (AMX: zero up to a whole tile) */
    for (int64_t v = 0; v < Vpad; v++)
      for (int64_t d = 0; d < D; d++) Qb[v][d] = v < V ? f32_bf16(Q[v][d]) : 0;
#ifdef ATTN_AMX
  if (amx) {
    const int rows = V < 16 ? (int)V : 16;  /* a decode row's 3 vectors: 3-row tiles (a row's result is the same) */
    if (*tile_rows != rows) attn_amx_configure(*tile_rows = rows);
  }
#endif
  /* the chunks every row reads by slot: all of them, or with a tree those wholly before `prefix` */
  const int64_t shared = tree ? (prefix / CH) * CH : last;
  int64_t offs[CH], next[CH];
  chunk_slots(a, b, h, 0, shared < CH ? shared : CH, offs);
  for (int64_t c = 0; c < shared; c += CH) {
    if (c > 0) memcpy(offs, next, sizeof offs);  /* walked (and prefetched) by the chunk before */
    const int64_t n = (shared - c < CH) ? shared - c : CH;
    const int64_t n2 = (shared - c - CH < CH) ? shared - c - CH : CH;  /* the next chunk's positions */
    if (n2 > 0) {
      /* the pages are scattered, so no hardware prefetcher sees the next chunk coming: ask for its K and V
         rows now, while this chunk computes (a hint only; it changes no result). Into L2 (prefetcht2): into L1
         (prefetcht0) a chunk's 64 lines outran the core's L1 miss buffers and the kernel waited on its K loads
         (a b32 decode step's attention over 350 positions: 31 ms, 25 ms with this hint; further ahead than one
         chunk read no faster, on the AMX path too) */
      chunk_slots(a, b, h, c + CH, n2, next);
      const int64_t esize = a->dt == 0 ? 4 : 2, row_bytes = D * esize;
      const char* pool = (const char*)a->pool;
      for (int64_t j = 0; j < n2; j++)
        for (int64_t byte = 0; byte < row_bytes; byte += 64) {
          __builtin_prefetch(pool + (next[j] + a->k_off) * esize + byte, 0, 1);
          __builtin_prefetch(pool + (next[j] + a->v_off) * esize + byte, 0, 1);
        }
    }
    /* visible keys of each row in the chunk: vis 0 / -inf added to the scores, keep 1 / 0 multiplying the
       probabilities (a masked key's weight is exactly 0, whatever exp gives for -inf) */
    float vis[nr][CH], keep[nr][CH];
    int64_t act[V], nact = 0;  /* the vectors whose row sees some key of the chunk */
    const int full = n == CH && c + CH <= prefix;  /* the whole chunk lies before the mask block: all visible */
    for (int64_t i = 0; i < nr; i++) {
      const int64_t row = r0 + i;
      if (full) {
        for (int64_t g = 0; g < G; g++) act[nact++] = i * G + g;
        continue;
      }
      int any = 0;
      for (int64_t j = 0; j < CH; j++) {
        int64_t pos = c + j;
        int ok = j < n && pos < kv_len;
        if (ok && pos >= prefix) ok = pos - prefix <= row;
        vis[i][j] = ok ? 0.0f : -INFINITY;
        keep[i][j] = ok ? 1.0f : 0.0f;
        any |= ok;
      }
      if (any) for (int64_t g = 0; g < G; g++) act[nact++] = i * G + g;
    }
    if (nact) run_chunk(&k, offs, n, (const float (*)[CH])vis, (const float (*)[CH])keep, full, act, nact);
  }
  if (tree) {  /* from the chunk holding `prefix` on: each row its own keys, by position */
    for (int64_t i = 0; i < nr; i++) {
      const int64_t row = r0 + i;
      int64_t path[width], depth = 0;  /* the row's visible tree slots in index order: path[d] at depth d */
      for (int64_t t = 0; t < width; t++)
        if (tree[row * width + t]) path[depth++] = t;
      const int64_t end = prefix + depth;  /* one past the row's own position */
      int64_t act[GMAX];
      for (int64_t g = 0; g < G; g++) act[g] = i * G + g;
      for (int64_t c = shared; c < end; c += CH) {
        const int64_t n = end - c < CH ? end - c : CH;
        for (int64_t j = 0; j < n; j++) {
          const int64_t pos = c + j;
          chunk_slots(a, b, h, pos < prefix ? pos : prefix + path[pos - prefix], 1, offs + j);
        }
        float vis[nr][CH], keep[nr][CH];  /* row i's: the first n lanes, as a decode row's last chunk */
        for (int64_t j = 0; j < CH; j++) { vis[i][j] = j < n ? 0.0f : -INFINITY; keep[i][j] = j < n ? 1.0f : 0.0f; }
        run_chunk(&k, offs, n, (const float (*)[CH])vis, (const float (*)[CH])keep, n == CH, act, G);
      }
    }
  }
  for (int64_t i = 0; i < nr; i++) {
    int64_t t = q_start + r0 + i;
    for (int64_t g = 0; g < G; g++) {
      const int64_t v = i * G + g;
      const float inv = l[v] > 0.0f ? 1.0f / l[v] : 0.0f;
      float o[DMAX];
      if (k.permuted) {  /* vector 2h: dims 32h + 2i; vector 2h + 1: dims 32h + 2i + 1 */
        for (int64_t h0 = 0; h0 < D; h0 += 32)
          for (int64_t i2 = 0; i2 < 16; i2++) {
            o[h0 + 2 * i2] = acc[v][h0 + i2] * inv;
            o[h0 + 2 * i2 + 1] = acc[v][h0 + 16 + i2] * inv;
          }
      } else {
        for (int64_t d = 0; d < D; d++) o[d] = acc[v][d] * inv;
      }
      store(a->out, a->dt, t * a->Hq * D + (h * G + g) * D, D, o);
    }
  }
}

/* Write Tw new tokens' K (RoPE'd at w_pos) and V into the pool at slots w_slot (page * ps + offset). */
static void write_kv(const Args* a, const void* k, const void* v, int64_t kv_stride, int64_t Tw, const int64_t* w_pos,
                     const int64_t* w_slot) {
  const int64_t D = a->D;
  #pragma omp parallel for schedule(static) if (Tw * a->Hkv > 512)
  for (int64_t t = 0; t < Tw; t++) {
    const int64_t page = w_slot[t] / a->ps, within = w_slot[t] % a->ps;
    const int64_t base = page * a->page_stride + within * a->pos_stride;
    for (int64_t h = 0; h < a->Hkv; h++) {
      float x[DMAX];
      load(k, a->dt, t * kv_stride + h * D, D, x);
      if (a->cos_t) rope(x, a->cos_t + w_pos[t] * D, a->sin_t + w_pos[t] * D, D);
      store(a->pool, a->dt, base + a->k_off + h * a->head_stride, D, x);
      load(v, a->dt, t * kv_stride + h * D, D, x);
      store(a->pool, a->dt, base + a->v_off + h * a->head_stride, D, x);
    }
  }
}

int specpd_attention(int dt,
                     const void* q, int64_t q_stride, const int64_t* q_pos,
                     const void* k, const void* v, int64_t kv_stride, int64_t Tw, const int64_t* w_pos,
                     const int64_t* w_slot,
                     const float* cos_t, const float* sin_t,
                     void* pool, int64_t page_stride, int64_t k_off, int64_t v_off, int64_t pos_stride,
                     int64_t head_stride, int64_t ps,
                     const int32_t* qo_indptr, const int32_t* kv_lens, const int32_t* page_table, int64_t max_pages,
                     int64_t B, const uint8_t* tree, const int32_t* tree_indptr,
                     int64_t Hq, int64_t Hkv, int64_t D, float scale, void* out) {
  if (D > DMAX || D % 2 || Hkv <= 0 || Hq % Hkv || Hq / Hkv > GMAX) return 1;
  Args a = {dt, q, q_stride, q_pos, cos_t, sin_t, pool, page_stride, k_off, v_off, pos_stride, head_stride, ps,
            qo_indptr, kv_lens, page_table, max_pages, tree, tree_indptr, Hq, Hkv, D, scale, out};
  if (k) write_kv(&a, k, v, kv_stride, Tw, w_pos, w_slot);
  if (!q) return 0;
  /* work items: (sequence, kv head, block of rb rows); rough cost = rows x visible keys. Threads from ~1000
     row-keys x heads on: a decode row over 300 positions (9 query / 3 KV heads: 2700) costs ~55 us on one thread
     a layer, latency-bound on its scattered pages, and 2 threads take a b1 step's attention from ~1.7 to ~1.2 ms
     (the OpenMP team is warm from the GEMMs). Blocks of RB rows, or fewer where that leaves the threads fewer than
     two items each (a b1 tree verify's 8 rows over 3 KV heads: 3 items, one thread doing two). An item is computed
     the same on any thread and a row the same in any block: no result changes. */
  int64_t items = 0, work = 0, longest = 0;
  for (int64_t b = 0; b < B; b++) {
    int64_t ql = qo_indptr[b + 1] - qo_indptr[b];
    items += Hkv * ((ql + RB - 1) / RB);
    work += ql * (int64_t)kv_lens[b] * Hq;
    if (ql > longest) longest = ql;
  }
  int64_t rb = RB;
  const int64_t want = 2 * (int64_t)omp_get_max_threads();
  if (items < want && longest > 1) {  /* split the row blocks (more K/V loads, but every thread busy) */
    const int64_t per_seq = (want + Hkv * B - 1) / (Hkv * B);  /* blocks wanted per sequence and head */
    rb = (longest + per_seq - 1) / per_seq;
    if (rb < 1) rb = 1;
    if (rb > RB) rb = RB;
    items = 0;
    for (int64_t b = 0; b < B; b++) items += Hkv * ((qo_indptr[b + 1] - qo_indptr[b] + rb - 1) / rb);
  }
#ifdef ATTN_AMX
  const int amx = attn_use_amx && dt == 1 && D % 32 == 0;
#else
  const int amx = 0;
#endif
  #pragma omp parallel if (items > 1 && work > 1024)
  {
  int tile_rows = 0;  /* this thread's tile configuration: the vector rows of a group (0: none yet) */
  #pragma omp for schedule(dynamic, 1)
  for (int64_t it = 0; it < items; it++) {
    int64_t rest = it, b = 0;
    for (; b < B; b++) {
      int64_t ql = qo_indptr[b + 1] - qo_indptr[b], n = Hkv * ((ql + rb - 1) / rb);
      if (rest < n) break;
      rest -= n;
    }
    int64_t ql = qo_indptr[b + 1] - qo_indptr[b];
    int64_t blocks = (ql + rb - 1) / rb, h = rest / blocks, blk = rest % blocks;
    int64_t r0 = blk * rb, nr = (ql - r0 < rb) ? ql - r0 : rb;
    attend_block(&a, b, h, r0, nr, amx, &tile_rows);
  }
#ifdef ATTN_AMX
  if (tile_rows) _tile_release();
#endif
  }
  return 0;
}
