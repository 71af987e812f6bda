/* x's rows as int8 codes for the integer kernels of int8 weight blocks (csrc/gemv_q8.c: GGUF's Q8_0) and of Q6_K
 * superblocks (csrc/gemv_q6k.c): per row (one scale) or per block of 32 (a scale each, llama.cpp's Q8_0 x). The
 * includer includes <math.h>, <string.h>, <stdint.h> and, with AVX-512, <immintrin.h>. */
#ifndef MINIVLLM_STAGE_ROWS_H
#define MINIVLLM_STAGE_ROWS_H

/* x[k0, k1) as int8 codes at scale s (k0 a multiple of 32), each block's sum of codes added to xg. Division, not a
 * reciprocal (see csrc/quantize_rows.c): the codes must be torch.round(x / s)'s. */
__attribute__((optimize("no-unsafe-math-optimizations")))
static void stage_codes(const float *xr, int64_t k0, int64_t k1, float s, int8_t *dst, float *xg) {
    int64_t k = k0;
#if defined(__AVX512F__)
    const __m512 sv = _mm512_set1_ps(s);
    for (; k + 32 <= k1; k += 32) { /* round half to even, as torch.round */
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(xr + k), sv));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(xr + k + 16), sv));
        _mm_storeu_si128((__m128i *)(dst + k), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(dst + k + 16), _mm512_cvtsepi32_epi8(q1));
        xg[k / 32] = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
#endif
    for (; k < k1; k++) {
        const int8_t q = (int8_t)__builtin_lrintf(xr[k] / s);
        dst[k] = q;
        xg[k / 32] += (float)q;
    }
}

/* One row of x as int8 codes (zero-padded to Kx bytes), its per-block sums in xg (zero-padded to nbp); returns
 * its scale. With xb (activation blocks): each block its own scale in xb (zero-padded to nbp), xg[b] that block's
 * sum times its scale, and the row's scale 1. */
__attribute__((optimize("no-unsafe-math-optimizations")))
static float stage_row(const float *xr, int64_t K, int8_t *dst, int64_t Kx, float *xg, int64_t nbp, float *xb) {
    memset(dst, 0, (size_t)Kx);
    memset(xg, 0, (size_t)nbp * sizeof(float));
    if (xb) memset(xb, 0, (size_t)nbp * sizeof(float));
    for (int64_t k0 = 0; k0 < K; k0 += xb ? 32 : K) {
        const int64_t k1 = xb && k0 + 32 < K ? k0 + 32 : K;
        float amax = 0.f;
#pragma omp simd reduction(max : amax)
        for (int64_t k = k0; k < k1; k++) amax = fmaxf(amax, fabsf(xr[k]));
        const float s = amax > 0.f ? amax / 127.f : 1.f;
        stage_codes(xr, k0, k1, s, dst, xg);
        if (!xb) return s;
        xb[k0 / 32] = s;
        xg[k0 / 32] *= s;
    }
    return 1.f;
}

#endif
