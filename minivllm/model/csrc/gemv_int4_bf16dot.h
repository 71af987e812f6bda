/* int4 weight-only at one token against a bf16 x (a bfloat16 model's activations: GPTQ and AWQ checkpoints served as
 * they ship, vLLM's W4A16) by AVX512-BF16's dot product. csrc/gemv_avx512.h's float rows (int4_row_m1_avx512) spend a
 * conversion and a multiply-add per 16 weights on the two float pipes, and ran 20-25 GB/s even from the cache on a
 * 2-vCPU Zen 4 (0.83x llama.cpp's Q4_0 at b=1). Here a code becomes a bf16 with no conversion: q shifted into the
 * top of a bf16 mantissa under the exponent of 16 is exactly 16 + q (a shift and one vpternlogd per 32 weights, on
 * the integer side), and one vdpbf16ps takes 32 products. Every product is exact (bf16 times bf16 fits float32) and
 * the 16 * sum(x) each group's codes carry comes off through the group sums of x the mins already use: scale * q +
 * min = scale * (16 + q) + (min - 16 scale). So the result is the float path's up to the order of float32 sums (and
 * subnormal x, which the instruction reads as zero). Any x with a bit below bf16's precision takes the float rows:
 * the caller checks once a call (bf16_exact, csrc/gemv_bf16dot.h). Included after csrc/gemv_avx512.h. */
#ifndef MINIVLLM_GEMV_INT4_BF16DOT_H
#define MINIVLLM_GEMV_INT4_BF16DOT_H

#if defined(INT4_M1_CHUNK) && defined(GEMV_INT4_AVX512) && defined(__AVX512BF16__)
#define GEMV_INT4_BF16DOT 1

/* x (bf16-exact) as the rows read it: chunk c's part p (0..3) is 32 bf16, 16-bit lane 2j + h holding x at nibble
 * field p + 4h of the chunk's int32 lane j (int4_stage_m1's map from a field to k); zero past K. xg: the per-group
 * sums of x, as int4_stage_m1 leaves them. */
INLINE void int4_stage_m1_bf16(uint16_t *xb, float *xg, const float *x, int64_t K, int64_t Kp, int64_t G) {
    const int64_t nchunks = (Kp + 127) / 128, ng = Kp / G;
    for (int64_t c = 0; c < nchunks; c++)
        for (int p = 0; p < 4; p++)
            for (int j = 0; j < 16; j++)
                for (int h = 0; h < 2; h++) {
                    const int f = p + 4 * h;
                    const int64_t k = 128 * c + 32 * (j / 4) + 16 * (f & 1) + 4 * (j % 4) + f / 2;
                    uint32_t u = 0;
                    if (k < K) memcpy(&u, x + k, sizeof u);
                    xb[(c * 4 + p) * 32 + 2 * j + h] = (uint16_t)(u >> 16);
                }
    for (int64_t g = 0; g < (ng + 15) / 16 * 16; g++) {
        float t = 0.f;
        if (g < ng)
            for (int64_t k = g * G; k < (g + 1) * G && k < K; k++) t += x[k];
        xg[g] = t;
    }
}

/* R (1, 2 or 4) rows from n a pass: per 128 weights of a row one load, four shifts and four vpternlogd (the 16-bit
 * lanes' nibbles p and p + 4 at once), four vdpbf16ps and one multiply-add by the lanes' group scales (the window of
 * csrc/group_window.h); the four loads of x serve the R rows. Rows a pass and the prefetch two passes ahead (into L1,
 * or L2 with l2) follow W4A8's start-up choice (gemv_w4a8_m1_order): the same layout, read the same way. On a
 * 2-vCPU Zen 4 a chunk costs ~11 cycles from L1, four of them the vdpbf16ps (two cycles each at 512 bits, as two
 * FMAs): as many products a cycle as float FMAs, but no int-to-float conversion. `ahead`: the rows two passes on
 * exist. */
INLINE void int4_rows_m1_bf16dot(float *out, const uint16_t *xb, const float *xg, const Layer *L, int64_t n,
                                 const int R, int ahead, int l2) {
    const int64_t Kp = L->Kv, G = L->G, ng = Kp / G, nbytes = Kp / 2, nchunks = (Kp + 127) / 128;
    const uint8_t *w = (const uint8_t *)L->w + n * nbytes;
    const uint16_t *scale = (const uint16_t *)L->scale + n * ng;
    const int shift = __builtin_ctzll((uint64_t)(G / 32));
    const __m512i field = _mm512_set1_epi16(0x78), sixteen = _mm512_set1_epi16(0x4180); /* bf16 16.0 */
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
            const uint16_t *xc = xb + c * 128;
            const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)xc),
                           x1 = (__m512bh)_mm512_loadu_si512((const void *)(xc + 32)),
                           x2 = (__m512bh)_mm512_loadu_si512((const void *)(xc + 64)),
                           x3 = (__m512bh)_mm512_loadu_si512((const void *)(xc + 96));
            for (int r = 0; r < R; r++) {
                const __m512i wv = int4_chunk(w + r * nbytes, nbytes, c);
/* nibbles p of each 16-bit lane as 16 + q: (the shifted lane & 0x78) | 0x4180 */
#define PART(v) ((__m512bh)_mm512_ternarylogic_epi32((v), field, sixteen, 0xEA))
                __m512 t0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), PART(_mm512_slli_epi16(wv, 3)), x0);
                __m512 t1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), PART(_mm512_srli_epi16(wv, 1)), x1);
                t0 = _mm512_dpbf16_ps(t0, PART(_mm512_srli_epi16(wv, 5)), x2);
                t1 = _mm512_dpbf16_ps(t1, PART(_mm512_srli_epi16(wv, 9)), x3);
#undef PART
                acc[r] = _mm512_fmadd_ps(_mm512_add_ps(t0, t1), _mm512_permutexvar_ps(idx[u], win[r]), acc[r]);
            }
        }
    }
    int4_rows_add_mins(acc, L, n, R, xg, -16.f); /* + (min - 16 scale) * sum(x) per group */
    for (int r = 0; r < R; r++) out[n + r] = _mm512_reduce_add_ps(acc[r]) + (L->bias ? L->bias[n + r] : 0.f);
}
#elif defined(INT4_M1_CHUNK) /* no AVX512-BF16: never taken (the caller's dot is 0), so it needs no #ifdef */
INLINE void int4_stage_m1_bf16(uint16_t *xb, float *xg, const float *x, int64_t K, int64_t Kp, int64_t G) {
    (void)xb, (void)xg, (void)x, (void)K, (void)Kp, (void)G;
}
INLINE void int4_rows_m1_bf16dot(float *out, const uint16_t *xb, const float *xg, const Layer *L, int64_t n,
                                 const int R, int ahead, int l2) {
    (void)out, (void)xb, (void)xg, (void)L, (void)n, (void)R, (void)ahead, (void)l2;
}
#endif

#endif
