/* int4 weight-only at one token against a float32 x taken as int16 in blocks of 32, by AVX512-VNNI's vpdpwssd
 * (32 products of int16 pairs an instruction, into int32). csrc/gemv_avx512.h's float rows (int4_row_m1_avx512)
 * spend an int-to-float conversion and a multiply-add per 16 weights on the float pipes: ~27 instructions per 128
 * weights, 20-25 GB/s even from the cache on a 2-vCPU Zen 4 (0.66-0.83x llama.cpp's Q4_0 at b=1). Here each
 * 16-bit lane of a 64-byte chunk holds 4 codes; code p of every lane is one shift and one and away (the last just a
 * shift), already an int16, so per 128 weights: a load, 7 shifts and ands on the integer side, 4 vpdpwssd, an add,
 * one conversion and the lanes' scales (the group scale window of csrc/group_window.h times x's block scales) in a
 * multiply and a multiply-add: 17. x's rounding: at most half of 2^-15 of its block's largest magnitude per element
 * (as csrc/gemv_avx2.h's AVX2 rows), 128x finer than a bfloat16 model's activations; the groups' sums of x that meet
 * the mins come from the same rounded x, so a row is exactly x's int16 image against the dequantized weights. A
 * bfloat16 model's x (bf16-exact) keeps csrc/gemv_int4_bf16dot.h's exact rows. Included after that header. */
#ifndef MINIVLLM_GEMV_INT4_INT16DOT_H
#define MINIVLLM_GEMV_INT4_INT16DOT_H

#if defined(INT4_M1_CHUNK) && defined(GEMV_INT4_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GEMV_INT4_INT16DOT 1
#define INT4_M1_X_INT16 1
#define INT4_X16_CHUNK_FLOATS 80 /* a chunk's staged x: 128 int16 (64 floats' room), then 16 float lane scales */

/* A chunk's codes as int16 lanes: part p holds the code at nibble p of each 16-bit lane (int4_stage_m1_int16's
 * order), one shift and one and away (the last just a shift). */
INLINE void int4_parts16(__m512i p[4], __m512i wv) {
    const __m512i nib = _mm512_set1_epi16(0x0F);
    p[0] = _mm512_and_si512(wv, nib);
    p[1] = _mm512_and_si512(_mm512_srli_epi16(wv, 4), nib);
    p[2] = _mm512_and_si512(_mm512_srli_epi16(wv, 8), nib);
    p[3] = _mm512_srli_epi16(wv, 12);
}

/* The chunk's 16 int32 lane sums against one token's staged x parts (four vpdpwssd, two chains). */
INLINE __m512i int4_dot16(const __m512i p[4], const __m512i x[4]) {
    const __m512i t0 = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), p[0], x[0]), p[2], x[2]);
    const __m512i t1 = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), p[1], x[1]), p[3], x[3]);
    return _mm512_add_epi32(t0, t1);
}

/* A token's staged x parts of chunk xc (int4_stage_m1_int16's layout). */
INLINE void int4_x16(__m512i x[4], const float *xc) {
    for (int p = 0; p < 4; p++) x[p] = _mm512_loadu_si512((const void *)(xc + 16 * p));
}

/* x as the rows read it, chunk c at xp + 80 c: part p (0..3) is 32 int16, lane L the weight at code p of the
 * chunk's 16-bit lane L (byte 2L + p / 2, nibble p % 2; a block's byte i holds its weights i and i + 16); then 16
 * floats, lane j the scale of block j / 4 (vpdpwssd's int32 lane j sums 16-bit lanes 2j and 2j + 1: bytes 4j to
 * 4j + 3, all of block j / 4). Each block: inv = 32767 / amax, rounded to nearest even; zero past K. xg: the
 * groups' sums of the rounded x, zero to a multiple of 16 groups. */
INLINE void int4_stage_m1_int16(float *xp, float *xg, const float *x, int64_t K, int64_t Kp, int64_t G) {
    const int64_t nchunks = (Kp + 127) / 128, ng = Kp / G;
    /* a block's 32 int16 in order to the four parts' 8 each: part p's lane j takes weight 2j + p / 2 + 16 (p % 2) */
    const __m512i order = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1,
                                           30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t g = 0; g < (ng + 15) / 16 * 16; g++) xg[g] = 0.f;
    for (int64_t c = 0; c < nchunks; c++) {
        int16_t *q = (int16_t *)(xp + c * INT4_X16_CHUNK_FLOATS);
        float *sc = xp + c * INT4_X16_CHUNK_FLOATS + 64;
        for (int b = 0; b < 4; b++) {
            const int64_t k0 = 128 * c + 32 * b, nk = K - k0 < 32 ? (K - k0 > 0 ? K - k0 : 0) : 32;
            const __mmask16 m0 = (__mmask16)(nk >= 16 ? 0xffff : (1u << nk) - 1),
                            m1 = (__mmask16)(nk >= 32 ? 0xffff : nk > 16 ? (1u << (nk - 16)) - 1 : 0);
            const __m512 a = _mm512_maskz_loadu_ps(m0, x + k0), h = _mm512_maskz_loadu_ps(m1, x + k0 + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(a, sign), _mm512_and_ps(h, sign)));
            const float s = amax / 32767.f, inv = amax > 0.f ? 32767.f / amax : 0.f;
            /* (cvtps rounds to nearest even, as nearbyintf under the default rounding mode) */
            const __m512i va = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv))),
                          vh = _mm512_cvtps_epi32(_mm512_mul_ps(h, _mm512_set1_ps(inv)));
            const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(va, vh));
            const __m512i packed = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(va)),
                                                      _mm512_cvtepi32_epi16(vh), 1);
            const __m512i v16 = _mm512_permutexvar_epi16(order, packed);
            /* v16's lanes: evens of weights 0-15, evens of 16-31, odds of 0-15, odds of 16-31: parts 0, 1, 2, 3 */
            _mm_storeu_si128((__m128i *)(q + 8 * b), _mm512_castsi512_si128(v16));
            _mm_storeu_si128((__m128i *)(q + 32 + 8 * b), _mm512_extracti32x4_epi32(v16, 1));
            _mm_storeu_si128((__m128i *)(q + 64 + 8 * b), _mm512_extracti32x4_epi32(v16, 2));
            _mm_storeu_si128((__m128i *)(q + 96 + 8 * b), _mm512_extracti32x4_epi32(v16, 3));
            for (int j = 0; j < 4; j++) sc[4 * b + j] = s;
            if (k0 < Kp) xg[k0 / G] += (float)sum * s;
        }
    }
}

/* R (1, 2 or 4) rows from n a pass; rows a pass and the prefetch two passes ahead (into L1, or L2 with l2) follow
 * W4A8's start-up choice (gemv_w4a8_m1_order) as the bf16 rows do: the same layout, read the same way. The four
 * loads of x and the lane scales serve the R rows. `ahead`: the rows two passes on exist. */
INLINE void int4_rows_m1_int16(float *out, const float *xp, const float *xg, const Layer *L, int64_t n, const int R,
                               int ahead, int l2) {
    const int64_t Kp = L->Kv, G = L->G, ng = Kp / G, nbytes = Kp / 2, nchunks = (Kp + 127) / 128;
    const uint8_t *w = (const uint8_t *)L->w + n * nbytes;
    const uint16_t *scale = (const uint16_t *)L->scale + n * ng;
    const int shift = __builtin_ctzll((uint64_t)(G / 32));
    __m512i idx[4];
    window_index(idx, shift);
    __m512 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    /* the scales and mins of the pass after next (csrc/gemv_rows.h; past the last row a prefetch is a no-op) */
    prefetch_groups(L->scale, L->sym ? NULL : L->mins, n + 2 * R, R, ng, L->f32mins ? 4 : 2);
    int64_t c = 0;
    for (int64_t sb = 0; c < nchunks; sb++) {
        const int64_t g0 = (16 * sb) >> shift;
        const int cnt = ng - g0 < 16 ? (int)(ng - g0) : 16;
        __m512 win[4];
        for (int r = 0; r < R; r++)
            win[r] = int4_halves16(scale + r * ng + g0, L->f16, (__mmask16)((1u << cnt) - 1));
        for (int u = 0; u < 4 && c < nchunks; u++, c++) {
            if (ahead) int4_prefetch_pass(w, nbytes, c, R, l2);
            const float *xc = xp + c * INT4_X16_CHUNK_FLOATS;
            __m512i x[4];
            int4_x16(x, xc);
            const __m512 xs = _mm512_loadu_ps(xc + 64);
            for (int r = 0; r < R; r++) {
                __m512i p[4];
                int4_parts16(p, int4_chunk(w + r * nbytes, nbytes, c));
                const __m512 f = _mm512_cvtepi32_ps(int4_dot16(p, x));
                acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(_mm512_permutexvar_ps(idx[u], win[r]), xs), acc[r]);
            }
        }
    }
    int4_rows_add_mins(acc, L, n, R, xg, 0.f); /* + min * sum(x) per group */
    for (int r = 0; r < R; r++) out[n + r] = _mm512_reduce_add_ps(acc[r]) + (L->bias ? L->bias[n + r] : 0.f);
}
/* A few tokens (T, 1..4, staged by int4_stage_m1_int16 xstride floats apart, their group sums ngp apart) against
 * weight row n: each chunk's nibbles split once for the T tokens, each token's four vpdpwssd, a conversion and a
 * multiply-add by its lane scales. The float rows (int4_row_avx512) spend a table shuffle pair per 32 weights and a
 * multiply-add per 16 weights and token: a speculative verification's 5 tokens or a batch of 2-6 read a 1B-shaped
 * chain at 10-17 GB/s where one token's rows read 40. The row's scales and mins two rows on are prefetched (the rows
 * go one by one, csrc/gemv_rows.h). */
INLINE void int4_row_mt_int16(float *out, int64_t ldo, const float *xp, int64_t xstride, const float *xg,
                              int64_t ngp, const Layer *L, int64_t n, const int T) {
    const int64_t Kp = L->Kv, G = L->G, ng = Kp / G, nbytes = Kp / 2, nchunks = (Kp + 127) / 128;
    const uint8_t *w = (const uint8_t *)L->w + n * nbytes;
    const uint16_t *scale = (const uint16_t *)L->scale + n * ng;
    const int shift = __builtin_ctzll((uint64_t)(G / 32));
    __m512i idx[4];
    window_index(idx, shift);
    __m512 acc[4];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    prefetch_groups(L->scale, L->sym ? NULL : L->mins, n + 2, 1, ng, L->f32mins ? 4 : 2);
    int64_t c = 0;
    for (int64_t sb = 0; c < nchunks; sb++) {
        const int64_t g0 = (16 * sb) >> shift;
        const int cnt = ng - g0 < 16 ? (int)(ng - g0) : 16;
        const __m512 win = int4_halves16(scale + g0, L->f16, (__mmask16)((1u << cnt) - 1));
        for (int u = 0; u < 4 && c < nchunks; u++, c++) {
            __m512i p[4];
            int4_parts16(p, int4_chunk(w, nbytes, c));
            const __m512 s = _mm512_permutexvar_ps(idx[u], win);
            for (int t = 0; t < T; t++) {
                const float *xc = xp + t * xstride + c * INT4_X16_CHUNK_FLOATS;
                __m512i x[4];
                int4_x16(x, xc);
                const __m512 f = _mm512_cvtepi32_ps(int4_dot16(p, x));
                acc[t] = _mm512_fmadd_ps(f, _mm512_mul_ps(s, _mm512_loadu_ps(xc + 64)), acc[t]);
            }
        }
    }
    for (int64_t g0 = 0; g0 < ng; g0 += 16) { /* + min * sum(x) per group, each token's sums */
        const int cnt = ng - g0 < 16 ? (int)(ng - g0) : 16;
        const __mmask16 mk = (__mmask16)((1u << cnt) - 1);
        const __m512 mv = L->sym       ? _mm512_mul_ps(int4_halves16(scale + g0, L->f16, mk), _mm512_set1_ps(-8.f))
                        : L->f32mins ? _mm512_maskz_loadu_ps(mk, (const float *)L->mins + n * ng + g0)
                                     : int4_halves16((const uint16_t *)L->mins + n * ng + g0, L->f16, mk);
        for (int t = 0; t < T; t++) acc[t] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(xg + t * ngp + g0), acc[t]);
    }
    for (int t = 0; t < T; t++) out[t * ldo + n] = _mm512_reduce_add_ps(acc[t]) + (L->bias ? L->bias[n] : 0.f);
}
#endif

#endif
