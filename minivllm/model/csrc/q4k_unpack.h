/* GGUF's Q4_K superblocks unpacked (csrc/gemv_q4k.c's rows, csrc/gemm_a8.c's tiles; the layout is described in
 * csrc/gemv_q4k.c). The includer includes <stdint.h> and <string.h>. */
#ifndef MINIVLLM_Q4K_UNPACK_H
#define MINIVLLM_Q4K_UNPACK_H

#define Q4K_BYTES 144 /* bytes a superblock of 256 weights */

static inline float q4_half(const uint8_t *p) {
    _Float16 v;
    memcpy(&v, p, sizeof v);
    return (float)v;
}

/* The 12 bytes of 6-bit scales and mins as 16 bytes: sc[0..7] then m[0..7] (ggml's get_scale_min_k4, a word at a
 * time: bytes 0-3 hold sc 0-3 and the top bits of sc 4-7, bytes 4-7 m 0-3 and the top bits of m 4-7, bytes 8-11
 * the low nibbles of sc 4-7 and, above them, of m 4-7). */
static inline __attribute__((always_inline)) void q4k_scales(const uint8_t *b, uint32_t out[4]) {
    uint32_t u[3];
    memcpy(u, b + 4, sizeof u);
    out[0] = u[0] & 0x3f3f3f3fu;
    out[1] = (u[2] & 0x0f0f0f0fu) | ((u[0] >> 6) & 0x03030303u) << 4;
    out[2] = u[1] & 0x3f3f3f3fu;
    out[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 6) & 0x03030303u) << 4;
}

#if defined(__AVX2__)
#include <immintrin.h>
/* q4k_scales in one register, from the superblock's first 16 bytes (dwords: d and dmin, u0, u1, u2): sc 0-3 and m 0-3
 * are u0 and u1's low 6 bits a byte, sc 4-7 and m 4-7 the low and high nibbles of u2 with u0's and u1's top two bits
 * of each byte above them ((u >> 2) & 0x30 a byte: bits 6-7 to 4-5). */
static inline __attribute__((always_inline)) __m128i q4k_scales128(__m128i head) {
    const __m128i low = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(head, _MM_SHUFFLE(3, 2, 3, 1)),
                                                     _mm_set_epi32(4, 0, 0, 0)),
                                      _mm_set_epi32(0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f));
    const __m128i top = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(head, _MM_SHUFFLE(2, 0, 1, 0)), 2),
                                      _mm_set_epi32(0x30303030, 0, 0x30303030, 0));
    return _mm_or_si128(low, top);
}
#endif

/* A superblock's 8 sub-block scales d * sc into s[j * stride], its mins -dmin * m into mn[j * stride]
 * (w = s q + mn). */
static inline __attribute__((always_inline)) void q4k_scale_floats(const uint8_t *b, float *s, float *mn,
                                                                   int64_t stride) {
    uint32_t sm[4];
    q4k_scales(b, sm);
    const uint8_t *v = (const uint8_t *)sm;
    const float d = q4_half(b), dmin = q4_half(b + 2);
    for (int j = 0; j < 8; j++) {
        s[j * stride] = d * (float)v[j];
        mn[j * stride] = -dmin * (float)v[8 + j];
    }
}

/* A superblock's 256 codes (0..15) in weight order into q; its scales and mins as q4k_scale_floats. */
static inline __attribute__((always_inline)) void q4k_unpack(const uint8_t *b, uint8_t *q, float *s, float *mn) {
    const uint8_t *qs = b + 16;
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 32; i++) {
            q[64 * c + i] = qs[32 * c + i] & 15;
            q[64 * c + 32 + i] = qs[32 * c + i] >> 4;
        }
    q4k_scale_floats(b, s, mn, 1);
}

#endif
