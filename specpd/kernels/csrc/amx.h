/* AMX tiles for the kernels that multiply on them (cpu_gemm_bf16.c, cpu_attention.c; cpu_stack.c includes both):
   Linux's permission for the tile state, and a palette-1 tile configuration. Include where __AMX_TILE__ and
   __AMX_BF16__ are defined. */
#ifndef SPECPD_AMX_H
#define SPECPD_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Ask Linux for the AMX tile state (per process, Linux 5.16+); whether it was granted. */
static inline int amx_request(void) {
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} __attribute__((packed, aligned(64))) amx_tile_config;

/* tiles 0..7: rows[t] rows of colsb[t] bytes each */
static inline void amx_load_config(const int rows[8], const int colsb[8]) {
  amx_tile_config c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; t++) {
    c.rows[t] = (uint8_t)rows[t];
    c.colsb[t] = (uint16_t)colsb[t];
  }
  _tile_loadconfig(&c);
}
#endif
