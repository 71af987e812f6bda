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

/* A superblock's 256 codes (0..15) in weight order into q; its 8 sub-block scales d * sc into s, mins -dmin * m into
 * mn (w = s q + mn). */
static inline __attribute__((always_inline)) void q4k_unpack(const uint8_t *b, uint8_t *q, float *s, float *mn) {
    const uint8_t *qs = b + 16;
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 32; i++) {
            q[64 * c + i] = qs[32 * c + i] & 15;
            q[64 * c + 32 + i] = qs[32 * c + i] >> 4;
        }
    uint32_t sm[4];
    q4k_scales(b, sm);
    const uint8_t *v = (const uint8_t *)sm;
    const float d = q4_half(b), dmin = q4_half(b + 2);
    for (int j = 0; j < 8; j++) {
        s[j] = d * (float)v[j];
        mn[j] = -dmin * (float)v[8 + j];
    }
}

#endif
