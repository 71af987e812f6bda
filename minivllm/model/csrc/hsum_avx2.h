/* Reductions shared by the AVX2 row kernels (csrc/gemv_avx2.h, csrc/gemv_w4a8_avx2.h); includers include
 * <immintrin.h> and compile for AVX2. */
#ifndef MINIVLLM_HSUM_AVX2_H
#define MINIVLLM_HSUM_AVX2_H

/* The sums of eight vectors, lane i the sum of a[i]: a transpose by horizontal adds, 9 instructions for all eight
 * (a reduction each took about 8 with its scalar adds: a fifth of a 576-wide row's instructions at 8 tokens). */
static inline __attribute__((always_inline)) __m256 hsum8x8(const __m256 *a) {
    const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

/* The same for int32 lanes. */
static inline __attribute__((always_inline)) __m256i hsum8x8_epi32(const __m256i *a) {
    const __m256i q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    const __m256i q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
}

#endif
