/* Group scales of the int4 layouts on AVX-512 (AVX512BW), shared by csrc/gemv_w4a8.c's W4A8 rows and
 * csrc/gemv_avx512.h's weight-only rows (the nibble split also by csrc/gemm_a8.c's tiles): both read a row 64 bytes
 * (128 weights, 4 blocks of 32) at a time as 16 int32 lanes, lane j holding 4 bytes of block j / 4, and fetch a
 * 16-block superblock's group scales once as a window. Included inside their AVX-512 sections (immintrin.h already
 * in). */
#ifndef MINIVLLM_GROUP_WINDOW_H
#define MINIVLLM_GROUP_WINDOW_H

/* 16 bfloat16 (or, f16, float16) bit patterns widened to float. */
static inline __attribute__((always_inline)) __m512 half16(__m256i h, int f16) {
    return f16 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Chunk u's lanes pick their block's group (block 4u + lane / 4 of a 16-block superblock; `shift`: log2 of the
 * blocks per group) from the superblock's window of group scales. */
static inline __attribute__((always_inline)) void window_index(__m512i idx[4], int shift) {
    const __m512i lane_block = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    for (int u = 0; u < 4; u++)
        idx[u] = _mm512_srli_epi32(_mm512_add_epi32(_mm512_set1_epi32(4 * u), lane_block), shift);
}

/* Each byte's high nibble (the int4 layouts' second weight of a byte). */
static inline __attribute__((always_inline)) __m512i high_nibbles(__m512i wv) {
#ifdef __GFNI__ /* each byte's high nibble in one instruction: the bit matrix sending bit i + 4 to bit i */
    return _mm512_gf2p8affine_epi64_epi8(wv, _mm512_set1_epi64(0x1020408000000000LL), 0);
#else
    return _mm512_and_si512(_mm512_srli_epi16(wv, 4), _mm512_set1_epi8(0x0F));
#endif
}

#endif
