/* A decoder stack in one call, bf16 or fp32: every layer of a Llama-family forward (RMSNorm with the residual
   add fused, the qkv GEMM, paged attention with RoPE and the KV write, the o GEMM, RMSNorm, gate/up GEMM, SiLU x
   up, the down GEMM) and the final norm, run from C with no Python between the kernels. It calls the same
   kernels the per-layer Python path calls (cpu_gemm_bf16.c or cpu_gemm_f32.c by the dtype, cpu_ops.c,
   cpu_attention.c, included here into one library), on the same inputs in the same order, so its output equals
   that path's bit for bit; what it removes is ~10 Python-level calls per layer (each a ctypes call, a tensor
   allocation, argument checks). dt: 1 = bf16 (AVX512-BF16), 0 = fp32 (AVX-512); a dtype whose GEMM kernel this
   CPU lacks returns 2. A linear in GGUF blocks (fmts: ggml's type id per linear, 0 for a dense one) runs on
   cpu_gemm_q.c in either dtype, on AVX2 as well: a model whose every linear is quantized runs its stack on any
   x86 CPU with AVX2. specpd/model/cpu_stack.py has the contract; tests/model/test_cpu_stack.py compares the
   two paths. */
#include "cpu_gemm_bf16.c"
#include "cpu_gemm_f32.c"
#include "cpu_gemm_q.c"
#include "cpu_ops.c"
#include "cpu_attention.c"

#define WEIGHTS_PER_LAYER 7  /* ln1, qkv (packed), qkv bias (fp32 or NULL), o (packed), ln2, gate_up (packed), down */

static inline int64_t elem_size(int dt) { return dt == 0 ? 4 : 2; }

/* the project's GEMM for the weight's format (fmt: ggml's type id of its blocks, 0 for a dense weight of the
   dtype; dt 0 fp32, 1 bf16: the callers admit no other): y[M, N] = x[M, K] @ W^T (+ bias), W packed by that
   kernel's pack */
static int gemm(int dt, int fmt, const void* x, int64_t M, int64_t K, const void* packed, const float* bias,
                int64_t N, void* y) {
  if (fmt) return specpd_gemm_q(fmt, dt, x, K, M, K, (const uint8_t*)packed, bias, N, y);
  if (dt == 0) return specpd_gemm_f32((const float*)x, M, K, (const float*)packed, bias, N, (float*)y);
  return specpd_gemm_bf16((const uint16_t*)x, M, K, (const uint16_t*)packed, bias, N, (uint16_t*)y);
}

/* dst = a + b over n elements in the dtype, as torch adds: an fp32 sum, rounded once (bf16: to nearest even) */
static void add_rows(int dt, const void* a, const void* b, void* dst, int64_t n) {
  if (dt == 0) {
    const float *x = (const float*)a, *y = (const float*)b;
    float* d = (float*)dst;
    for (int64_t i = 0; i < n; i++) d[i] = x[i] + y[i];
  } else {
    const uint16_t *x = (const uint16_t*)a, *y = (const uint16_t*)b;
    uint16_t* d = (uint16_t*)dst;
    for (int64_t i = 0; i < n; i++) d[i] = f32_bf16(bf16_f32(x[i]) + bf16_f32(y[i]));
  }
}

/* byte offset of element i of a dt tensor */
#define AT(p, i) ((char*)(p) + (i) * es)
#define CAT(p, i) ((const char*)(p) + (i) * es)

int specpd_stack(int dt, int64_t T, int64_t H, int64_t L, int64_t nqkv, int64_t inter, float eps,
                 const void* const* w, const int32_t* fmts, const void* final_norm,
                 void* h, void* res, void* normed, void* qkv, void* attn, void* gu, void* act, void* out,
                 const int64_t* capture, int64_t ncap, void* const* cap_out,
                 const int64_t* pos, const int64_t* w_slot, const float* cos_t, const float* sin_t,
                 void* pool, int64_t page_stride, int64_t layer_stride, int64_t kv_half, int64_t pos_stride,
                 int64_t head_stride, int64_t ps, const int32_t* qo_indptr, const int32_t* kv_lens,
                 const int32_t* page_table, int64_t max_pages, int64_t B, const uint8_t* tree,
                 const int32_t* tree_indptr, int64_t Hq, int64_t Hkv, int64_t D, float scale) {
  const int64_t es = elem_size(dt), q_width = Hq * D, kv_width = Hkv * D;
  if (nqkv != q_width + 2 * kv_width) return 3;
  if (dt != 0 && dt != 1) return 2;
  int have_res = 0, next_cap = 0;
  int rc = 0;
  for (int64_t l = 0; l < L && rc == 0; l++) {
    const void* const* lw = w + l * WEIGHTS_PER_LAYER;
    const int32_t* lf = fmts + l * 4;  /* qkv, o, gate_up, down */
    if (next_cap < ncap && capture[next_cap] == l) {  /* the layer's input, summed (EAGLE-3's aux features) */
      void* cap = cap_out[next_cap++];
      if (have_res) add_rows(dt, h, res, cap, T * H);
      else memcpy(cap, h, (size_t)(T * H * es));
      memcpy(h, cap, (size_t)(T * H * es));
      have_res = 0;
    }
    if (have_res) {
      rc |= specpd_rmsnorm(dt, h, res, lw[0], normed, res, T, H, eps);
    } else {
      rc |= specpd_rmsnorm(dt, h, 0, lw[0], normed, 0, T, H, eps);
      memcpy(res, h, (size_t)(T * H * es));
      have_res = 1;
    }
    rc |= gemm(dt, lf[0], normed, T, H, lw[1], lw[2], nqkv, qkv);
    const int64_t k_off = l * layer_stride;
    rc |= specpd_attention(dt, qkv, nqkv, pos, AT(qkv, q_width), AT(qkv, q_width + kv_width), nqkv, T, pos, w_slot,
                           cos_t, sin_t, pool, page_stride, k_off, k_off + kv_half, pos_stride, head_stride, ps,
                           qo_indptr, kv_lens, page_table, max_pages, B, tree, tree_indptr, Hq, Hkv, D, scale,
                           attn);
    rc |= gemm(dt, lf[1], attn, T, q_width, lw[3], 0, H, h);
    rc |= specpd_rmsnorm(dt, h, res, lw[4], normed, res, T, H, eps);
    rc |= gemm(dt, lf[2], normed, T, H, lw[5], 0, 2 * inter, gu);
    rc |= specpd_silu_mul(dt, gu, act, T, inter);
    rc |= gemm(dt, lf[3], act, T, inter, lw[6], 0, H, h);
  }
  if (rc == 0) rc |= specpd_rmsnorm(dt, h, res, final_norm, out, res, T, H, eps);
  return rc;
}

/* EAGLE-3's draft forward (specpd/spec/draft/eagle3.py, Eagle3Draft.forward and Eagle3MidLayer) in one call, on the
   kernels its Python path calls, in the same order: fc over the fused target features (when given), the two
   input norms side by side in one [T, 2H] row, qkv, paged attention at the draft's layer 0, o, the residual add,
   the post-attention norm, gate/up, SiLU x up, down, the second residual add. `rows` (R of them, or NULL for
   all T): the rows that attend and go on (every row's K/V is written), as OutputRows does: their queries and
   positions gathered into qg / qpos, and the attention metadata (qo_indptr .. tree_indptr) is then theirs.
   w: fc (packed, NULL when the input is already a draft hidden), fc bias (fp32 or NULL), input_layernorm,
   hidden_norm, qkv (packed), qkv bias, o (packed), post_attention_layernorm, gate_up (packed), down (packed);
   fmts: the five linears' formats (fc, qkv, o, gate_up, down: ggml's type id, 0 for a dense weight), as the
   target's stack takes them. */
int specpd_eagle3(int dt, int64_t T, int64_t H, int64_t fc_in, int64_t nqkv, int64_t inter, float eps,
                  int64_t norm_before_residual, const void* const* w, const int32_t* fmts, const void* feat, void* h,
                  const void* embeds, void* x, void* res, void* qkv, void* attn, void* tmp, void* gu, void* act,
                  const int64_t* rows, int64_t R, void* qg, int64_t* qpos, void* out,
                  const int64_t* pos, const int64_t* w_slot, const float* cos_t, const float* sin_t,
                  void* pool, int64_t page_stride, int64_t kv_half, int64_t pos_stride, int64_t head_stride,
                  int64_t ps, const int32_t* qo_indptr, const int32_t* kv_lens, const int32_t* page_table,
                  int64_t max_pages, int64_t B, const uint8_t* tree, const int32_t* tree_indptr, int64_t Hq,
                  int64_t Hkv, int64_t D, float scale) {
  const int64_t es = elem_size(dt), q_width = Hq * D, kv_width = Hkv * D;
  if (nqkv != q_width + 2 * kv_width) return 3;
  if (dt != 0 && dt != 1) return 2;
  int rc = 0;
  if (w[0]) rc |= gemm(dt, fmts[0], feat, T, fc_in, w[0], w[1], H, h);
  for (int64_t t = 0; t < T; t++) {  /* x = cat(input_layernorm(embeds), hidden_norm(h)) */
    rc |= specpd_rmsnorm(dt, CAT(embeds, t * H), 0, w[2], AT(x, t * 2 * H), 0, 1, H, eps);
    rc |= specpd_rmsnorm(dt, AT(h, t * H), 0, w[3], AT(x, t * 2 * H + H), 0, 1, H, eps);
  }
  rc |= gemm(dt, fmts[1], x, T, 2 * H, w[4], w[5], nqkv, qkv);
  const void* q = qkv;
  const int64_t* q_pos = pos;
  int64_t q_stride = nqkv;
  if (rows) {
    for (int64_t r = 0; r < R; r++) {
      memcpy(AT(qg, r * q_width), AT(qkv, rows[r] * nqkv), (size_t)(q_width * es));
      qpos[r] = pos[rows[r]];
    }
    q_stride = q_width;
    q = qg;
    q_pos = qpos;
  } else {
    R = T;
  }
  rc |= specpd_attention(dt, q, q_stride, q_pos, AT(qkv, q_width), AT(qkv, q_width + kv_width), nqkv, T, pos, w_slot,
                         cos_t, sin_t, pool, page_stride, 0, kv_half, pos_stride, head_stride, ps, qo_indptr, kv_lens,
                         page_table, max_pages, B, tree, tree_indptr, Hq, Hkv, D, scale, attn);
  for (int64_t r = 0; r < R; r++) {  /* the residual of the rows that go on */
    const int64_t src = rows ? rows[r] : r;
    memcpy(AT(res, r * H), norm_before_residual ? AT(x, src * 2 * H + H) : AT(h, src * H), (size_t)(H * es));
  }
  rc |= gemm(dt, fmts[2], attn, R, q_width, w[6], 0, H, tmp);
  add_rows(dt, res, tmp, res, R * H);
  rc |= specpd_rmsnorm(dt, res, 0, w[7], tmp, 0, R, H, eps);
  rc |= gemm(dt, fmts[3], tmp, R, H, w[8], 0, 2 * inter, gu);
  rc |= specpd_silu_mul(dt, gu, act, R, inter);
  rc |= gemm(dt, fmts[4], act, R, inter, w[9], 0, H, tmp);
  add_rows(dt, res, tmp, out, R * H);
  return rc;
}
