/* Element conversions shared by the CPU kernels: dtype code 0 = fp32, 1 = bf16, 2 = fp16 (DTYPE_CODES in
   specpd/kernels/build.py); math in fp32, bf16 rounded to nearest even as torch rounds. */
#ifndef SPECPD_DTYPES_H
#define SPECPD_DTYPES_H
#include <stdint.h>
#include <string.h>

static inline float bf16_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_bf16(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
  u += 0x7fffu + ((u >> 16) & 1u);  /* round to nearest even, as torch does */
  return (uint16_t)(u >> 16);
}

static inline void load(const void* base, int dt, int64_t off, int64_t n, float* restrict dst) {
  if (dt == 0) { const float* s = (const float*)base + off; for (int64_t i = 0; i < n; i++) dst[i] = s[i]; }
  else if (dt == 1) { const uint16_t* s = (const uint16_t*)base + off; for (int64_t i = 0; i < n; i++) dst[i] = bf16_f32(s[i]); }
  else { const _Float16* s = (const _Float16*)base + off; for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i]; }
}

static inline void store(void* base, int dt, int64_t off, int64_t n, const float* restrict src) {
  if (dt == 0) { float* d = (float*)base + off; for (int64_t i = 0; i < n; i++) d[i] = src[i]; }
  else if (dt == 1) { uint16_t* d = (uint16_t*)base + off; for (int64_t i = 0; i < n; i++) d[i] = f32_bf16(src[i]); }
  else { _Float16* d = (_Float16*)base + off; for (int64_t i = 0; i < n; i++) d[i] = (_Float16)src[i]; }
}

#endif
