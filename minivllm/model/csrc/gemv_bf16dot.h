/* csrc/gemv.c's one-token bf16 rows by AVX512-BF16's dot product (vdpbf16ps: 32 bf16 products summed in pairs into 16
 * float32 lanes, one instruction per 64 bytes of weights), where x itself is bf16: a bfloat16 model's activations
 * are, so every product is the one the float path forms (a bf16 times a bf16 is exact in float32) and only the order
 * of the float32 sums differs (and subnormals: the instruction reads them as zero and flushes them, 1e-38 apart). The float path (gemv_m1.h) widens each weight first: a shift, an and and two FMAs per
 * 32 weights, twice this one's instructions; on a 2-vCPU Zen 4 its rows ran 60-72 GB/s on weights in L2 against
 * f32's 112-134, which near a fast phase of the memory is the bound. Any x with a bit below bf16's precision takes
 * the float path (x is checked once a call: the kernel's contract is the float product). Included after gemv_m1.h. */
#ifndef MINIVLLM_GEMV_BF16DOT_H
#define MINIVLLM_GEMV_BF16DOT_H

/* Whether every float of x is a bf16 (its low 16 bits zero): a bfloat16 model's activations. */
INLINE int x_is_bf16(const float *x, int64_t K) {
    uint32_t low = 0;
    for (int64_t k = 0; k < K; k++) {
        uint32_t u;
        memcpy(&u, x + k, sizeof u);
        low |= u & 0xffffu;
    }
    return low == 0;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define GEMV_BF16_DOT 1

/* Whether the dot product's rows may take x: every float of it a bf16. */
INLINE int bf16_exact(const float *x, int64_t K) { return x_is_bf16(x, K); }

/* x (bf16-exact) as bf16 in xb: its high halves, zero-padded to a multiple of 32. */
INLINE void bf16_pack_x(uint16_t *xb, const float *x, int64_t K) {
    for (int64_t k = 0; k < K; k++) {
        uint32_t u;
        memcpy(&u, x + k, sizeof u);
        xb[k] = (uint16_t)(u >> 16);
    }
    for (int64_t k = K; k % 32; k++) xb[k] = 0;
}

/* 32 weights of a row at k (the last ones masked: a row's end may be the tensor's) against xb's. */
INLINE __m512 dot32(__m512 acc, const uint16_t *w, const uint16_t *xb, int64_t k, int64_t K) {
    const __mmask32 m = K - k >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << (K - k)) - 1);
    const __m512i wv = K - k >= 32 ? _mm512_loadu_si512((const void *)(w + k)) : _mm512_maskz_loadu_epi16(m, w + k);
    return _mm512_dpbf16_ps(acc, (__m512bh)wv, (__m512bh)_mm512_loadu_si512((const void *)(xb + k)));
}

INLINE void bf16dot_row(float *out, const uint16_t *xb, const Layer *L, int64_t n) {
    const int64_t K = L->K;
    const uint16_t *w = (const uint16_t *)L->w + n * K;
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t k = 0;
    for (; k + 128 <= K; k += 128)
        for (int i = 0; i < 4; i++) {
            PREFETCH_L2(w + k + 32 * i, L->pf);
            a[i] = dot32(a[i], w, xb, k + 32 * i, K);
        }
    for (int i = 0; k < K; k += 32, i++) a[i] = dot32(a[i], w, xb, k, K);
    out[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]))) +
             (L->bias ? L->bias[n] : 0.f);
}

/* R consecutive rows a pass (M1_ROWS, or 2 for M1_PAIRS), each load of xb serving them. */
INLINE void bf16dot_pass(float *out, const uint16_t *xb, const Layer *L, int64_t n, const int R) {
    const int64_t K = L->K;
    const uint16_t *w = (const uint16_t *)L->w + n * K;
    __m512 a[M1_ROWS];
    for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32)
        for (int r = 0; r < R; r++) {
            PREFETCH_L2(w + r * K + k, L->pf);
            a[r] = dot32(a[r], w + r * K, xb, k, K);
        }
    for (int r = 0; r < R; r++) out[n + r] = _mm512_reduce_add_ps(a[r]) + (L->bias ? L->bias[n + r] : 0.f);
}

/* M1_ROWS rows from n in the order `order` (gemv_m1.h's M1_PASS, M1_ONE, M1_PAIRS). */
INLINE void bf16dot_rows(float *out, const uint16_t *xb, const Layer *L, int64_t n, int order) {
    if (order == M1_ONE)
        for (int r = 0; r < M1_ROWS; r++) bf16dot_row(out, xb, L, n + r);
    else if (order == M1_PAIRS)
        for (int r = 0; r < M1_ROWS; r += 2) bf16dot_pass(out, xb, L, n + r, 2);
    else
        bf16dot_pass(out, xb, L, n, M1_ROWS);
}
#else /* no AVX512-BF16: never taken (bf16_exact says no), so the caller needs no #ifdef */
INLINE int bf16_exact(const float *x, int64_t K) { return (void)x, (void)K, 0; }
INLINE void bf16_pack_x(uint16_t *xb, const float *x, int64_t K) { (void)xb, (void)x, (void)K; }
INLINE void bf16dot_row(float *out, const uint16_t *xb, const Layer *L, int64_t n) {
    (void)out, (void)xb, (void)L, (void)n;
}
INLINE void bf16dot_rows(float *out, const uint16_t *xb, const Layer *L, int64_t n, int order) {
    (void)out, (void)xb, (void)L, (void)n, (void)order;
}
#endif

#endif
