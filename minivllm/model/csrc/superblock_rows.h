/* What the rows of GGUF's K-quant superblocks share (csrc/gemv_q6k.c, csrc/gemv_q4k.c): float lanes of 16 codes and
 * the weight-only rows' reduction. The includer includes <stdint.h> and, with AVX-512 or AVX2, <immintrin.h>. */
#ifndef MINIVLLM_SUPERBLOCK_ROWS_H
#define MINIVLLM_SUPERBLOCK_ROWS_H

typedef float v16 __attribute__((vector_size(64)));

/* 16 codes as float lanes. */
static inline __attribute__((always_inline)) v16 codes16(const uint8_t *p) {
#if defined(__AVX512F__)
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    v16 r;
    for (int i = 0; i < 16; i++) r[i] = (float)p[i];
    return r;
#endif
}

/* out[m, n] = the lanes of acc[m] summed, plus the bias, for the M rows of x of a weight-only row. */
static inline __attribute__((always_inline)) void store_rows16(float *out, int64_t ldo, const v16 *acc, int M,
                                                               const float *bias, int64_t n) {
    for (int m = 0; m < M; m++) {
        float t = 0.f;
        for (int i = 0; i < 16; i++) t += acc[m][i];
        out[m * ldo + n] = t + (bias ? bias[n] : 0.f);
    }
}

#endif
