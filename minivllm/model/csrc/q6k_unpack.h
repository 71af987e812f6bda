/* GGUF's Q6_K superblocks unpacked (csrc/gemv_q6k.c's rows, csrc/gemm_a8.c's tiles; the layout is described in
 * csrc/gemv_q6k.c). */
#ifndef MINIVLLM_Q6K_UNPACK_H
#define MINIVLLM_Q6K_UNPACK_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define SB_BYTES 210 /* bytes a superblock of 256 weights */

static inline float q6_half(const uint8_t *p) {
    _Float16 v;
    memcpy(&v, p, sizeof v);
    return (float)v;
}

/* A superblock's 256 codes (0..63) in weight order into q, its 16 scales d * sc into s. */
static inline __attribute__((always_inline)) void q6k_unpack(const uint8_t *b, uint8_t *q, float *s) {
#if defined(__AVX2__)
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        uint8_t *o = q + 128 * h;
        /* (the 16-bit shifts carry bits across bytes only where the masks drop them) */
        _mm256_storeu_si256((__m256i *)o, _mm256_or_si256(_mm256_and_si256(l0, m4),
                                                          _mm256_and_si256(_mm256_slli_epi16(hb, 4), m2)));
        _mm256_storeu_si256((__m256i *)(o + 32), _mm256_or_si256(_mm256_and_si256(l1, m4),
                                                                 _mm256_and_si256(_mm256_slli_epi16(hb, 2), m2)));
        _mm256_storeu_si256((__m256i *)(o + 64), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                                                 _mm256_and_si256(hb, m2)));
        _mm256_storeu_si256((__m256i *)(o + 96), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                                                 _mm256_and_si256(_mm256_srli_epi16(hb, 2), m2)));
    }
#else
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 128; i++) {
            const uint8_t l = b[64 * h + i % 64], hi = b[128 + 32 * h + i % 32];
            q[128 * h + i] = (uint8_t)((i < 64 ? l & 15 : l >> 4) | ((hi >> (2 * (i / 32))) & 3) << 4);
        }
#endif
    const float d = q6_half(b + 208);
    for (int j = 0; j < 16; j++) s[j] = d * (float)(int8_t)b[192 + j];
}

#endif
