/*
 * W8A8's activation quantization, shared by csrc/gemv.c's w8a8 rows and the many-token path around torch's
 * integer GEMM (model/quantization.py: forward_int_mm), and the rescale after that GEMM.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* One row of x as int8 codes, symmetric absmax / 127, round half to even; returns the scale. Division, not
 * a reciprocal: the codes must be torch.round(x / s)'s (GCC 12 kept -ffast-math's x * (1 / s) under
 * optimize("no-reciprocal-math"): ties like 19.5 rounded to 19; no-unsafe-math-optimizations divides). */
__attribute__((optimize("no-unsafe-math-optimizations")))
float quantize_row_s8(const float *xr, int64_t K, int8_t *xq) {
    float amax = 0.f;
#pragma omp simd reduction(max : amax)
    for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(xr[k]));
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    int64_t k = 0;
#if defined(__AVX512F__)
    const __m512 sv = _mm512_set1_ps(s);
    for (; k + 16 <= K; k += 16)
        _mm_storeu_si128((__m128i *)(xq + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(xr + k), sv))));
#elif defined(__AVX2__)
    const __m256 sv = _mm256_set1_ps(s); /* (the scalar division per element was ~2-5% of a many-token w8a8 GEMV) */
    for (; k + 16 <= K; k += 16) {       /* cvtps: round half to even; |q| <= 127, so the saturating packs are exact */
        const __m256i a = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(xr + k), sv));
        const __m256i b = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(xr + k + 8), sv));
        const __m128i ab = _mm_packs_epi16(_mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)),
                                           _mm_packs_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
        _mm_storeu_si128((__m128i *)(xq + k), ab);
    }
#endif
    for (; k < K; k++) xq[k] = (int8_t)__builtin_lrintf(xr[k] / s);
    return s;
}

/* W8A8 at many tokens, around torch's integer GEMM: each row of x quantized in one pass (absmax / 127,
 * round half to even) ... */
void quantize_rows_s8(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *xq, float *xs, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (M >= 8) schedule(static)
    for (int64_t m = 0; m < M; m++) xs[m] = quantize_row_s8(x + m * ldx, K, xq + m * K);
}

/* ... and the int32 products scaled back in one pass: out = acc * xs[m] * ws[n] (+ bias[n]). */
void rescale_i32(const int32_t *acc, int64_t M, int64_t N, const float *xs, const float *ws, const float *bias,
                 float *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (M >= 8) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        float s = xs[m];
#pragma omp simd
        for (int64_t n = 0; n < N; n++) out[m * N + n] = (float)acc[m * N + n] * s * ws[n] + (bias ? bias[n] : 0.f);
    }
}
