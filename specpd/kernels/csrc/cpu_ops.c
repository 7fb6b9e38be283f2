/* Elementwise glue of a decoder layer for CPU, each one pass over its rows (specpd/kernels/cpu_ops.py has the
   contract and the torch references): RMSNorm, the residual add fused into the next RMSNorm, and SiLU(gate) * up.
   Math in fp32, one rounding to the tensor's dtype at the store (a bf16 residual sum is rounded before it is
   normed, as torch's add then norm would). Rows are independent: OpenMP over rows for large batches. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dtypes.h"

/* round-trip through the dtype (what storing and reloading would give) */
static inline void round_to(int dt, int64_t n, float* restrict x) {
  if (dt == 1) for (int64_t i = 0; i < n; i++) x[i] = bf16_f32(f32_bf16(x[i]));
  else if (dt == 2) for (int64_t i = 0; i < n; i++) x[i] = (float)(_Float16)x[i];
}


/* exp(x), ~2 ulp over [-87, 88] (clamped outside), branch-free so loops over it vectorise */
static inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f; p = p * r + 8.3334519073e-3f; p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f; p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t e = ((int32_t)n + 127) << 23;
  float scale; memcpy(&scale, &e, 4);
  return p * scale;
}

#define BLK 64  /* elements per pass of a row: small local arrays keep the loops vectorisable */

/* out = x / rms(x) * w per row; with residual: sum = x + residual (rounded, stored to sum_out), then out =
   norm(sum). x, residual, out, sum_out: [rows, n] contiguous; w [n] in the same dtype. The sum of squares
   runs in 16 lanes folded in a fixed order, so a row's result does not depend on the batch. */
int specpd_rmsnorm(int dt, const void* x, const void* residual, const void* w, void* out, void* sum_out,
                   int64_t rows, int64_t n, float eps) {
  #pragma omp parallel for schedule(static) if (rows * n > 262144)
  for (int64_t r = 0; r < rows; r++) {
    float part[16] = {0};
    const void* src = residual ? sum_out : x;  /* what the norm reads back in the second pass */
    for (int64_t i0 = 0; i0 < n; i0 += BLK) {
      const int64_t m = n - i0 < BLK ? n - i0 : BLK;
      float v[BLK] = {0};
      load(x, dt, r * n + i0, m, v);
      if (residual) {
        float t[BLK];
        load(residual, dt, r * n + i0, m, t);
        for (int64_t i = 0; i < m; i++) v[i] += t[i];
        round_to(dt, m, v);
        store(sum_out, dt, r * n + i0, m, v);
      }
      for (int64_t i = 0; i < BLK; i += 16)
        for (int k = 0; k < 16; k++) part[k] += v[i + k] * v[i + k];
    }
    float ss = 0.0f;
    for (int k = 0; k < 16; k++) ss += part[k];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i0 = 0; i0 < n; i0 += BLK) {
      const int64_t m = n - i0 < BLK ? n - i0 : BLK;
      float v[BLK], wt[BLK];
      load(src, dt, r * n + i0, m, v);
      load(w, dt, i0, m, wt);
      for (int64_t i = 0; i < m; i++) v[i] = v[i] * inv * wt[i];
      store(out, dt, r * n + i0, m, v);
    }
  }
  return 0;
}

/* one row of silu_mul (outside the OpenMP-outlined loop: gcc vectorises it here) */
static void silu_mul_row(int dt, const void* gate_up, void* out, int64_t r, int64_t inter) {
  for (int64_t i0 = 0; i0 < inter; i0 += BLK) {
    const int64_t m = inter - i0 < BLK ? inter - i0 : BLK;
    float g[BLK], u[BLK];
    load(gate_up, dt, r * 2 * inter + i0, m, g);
    load(gate_up, dt, r * 2 * inter + inter + i0, m, u);
    for (int64_t i = 0; i < m; i++) g[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
    store(out, dt, r * inter + i0, m, g);
  }
}

/* out [rows, inter] = silu(gate) * up, gate_up [rows, 2 * inter] (gate first) */
int specpd_silu_mul(int dt, const void* gate_up, void* out, int64_t rows, int64_t inter) {
  #pragma omp parallel for schedule(static) if (rows * inter > 262144)
  for (int64_t r = 0; r < rows; r++) silu_mul_row(dt, gate_up, out, r, inter);
  return 0;
}
