/* The machine's own float vector (VL lanes) and its load, shared by csrc/gemv.c's one-token rows and csrc/membw.c:
 * a 64-byte GCC vector on AVX2 is two registers, and GCC compiled loops of them worse (a four-row GEMV pass streamed
 * 19-20 GB/s with them, 30-32 with 32-byte vectors; the probe read 20 GB/s where llama.cpp's decode streamed 28, on a
 * 2-core AVX2 EPYC). Includers include <string.h>. */
#ifndef MINIVLLM_SIMD_WIDTH_H
#define MINIVLLM_SIMD_WIDTH_H

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(VL * 4)));

static inline __attribute__((always_inline)) vf ldv(const float *p) { /* (a load into a register) */
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

#endif
