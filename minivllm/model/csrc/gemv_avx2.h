/* csrc/gemv.c's weight-only row kernels for AVX2 without AVX-512 (int4, int8); included there after Layer and
 * half_to_f32. On these CPUs 64-byte vectors are two registers each and GCC compiles the generic rows poorly. */
#ifndef MINIVLLM_GEMV_AVX2_H
#define MINIVLLM_GEMV_AVX2_H

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include "hsum_avx2.h"

INLINE float hsum256(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    float f[4];
    _mm_storeu_ps(f, h);
    return (f[0] + f[1]) + (f[2] + f[3]);
}

/* int4 on AVX2 for 2..MAX_M tokens (one token: int4_row_m1_avx2 below): 16-entry tables need two 8-lane permutes
 * and a blend here, and the 64-byte vectors above compile to scalar shuffles (1B shape, one token: 1.1 tok/s).
 * Instead each group's sum of q * x is taken in float (codes widened to int32 and converted: three instructions per
 * 8 weights) and scaled once per group; the mins meet the group's sum of x (xg, computed once per call). */
INLINE void int4_row_avx2(float *out, int64_t ldo, const float *x, const float *xg, int M, const Layer *L,
                          int64_t n) {
    const int64_t Kp = L->Kv, G = L->G, ng = Kp / G;
    const uint8_t *w = (const uint8_t *)L->w + n * (Kp / 2);
    const uint16_t *scale = (const uint16_t *)L->scale + n * ng;
    const uint16_t *mins = L->sym ? NULL : (const uint16_t *)L->mins + n * ng;
    const float *minf = L->sym ? NULL : (const float *)L->mins + n * ng;
    const __m128i nib = _mm_set1_epi8(0x0F);
    __m256 acc[MB];
    float ymin[MB] = {0.f};
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m256 sq[MB];
        for (int m = 0; m < M; m++) sq[m] = _mm256_setzero_ps();
        for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(w + k / 2));
            const __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
            const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
            const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
            const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
            const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
            for (int m = 0; m < M; m++) {
                const float *xr = x + m * Kp + k;
                sq[m] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(xr), sq[m]);
                sq[m] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xr + 8), sq[m]);
                sq[m] = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xr + 16), sq[m]);
                sq[m] = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xr + 24), sq[m]);
            }
        }
        const float s = half_to_f32(scale[g], L->f16);
        const float mn = L->sym ? -8.f * s : L->f32mins ? minf[g] : half_to_f32(mins[g], L->f16);
        const __m256 sv = _mm256_set1_ps(s);
        for (int m = 0; m < M; m++) {
            acc[m] = _mm256_fmadd_ps(sq[m], sv, acc[m]);
            ymin[m] += mn * xg[m * ng + g];
        }
    }
    for (int m = 0; m < M; m++) {
        out[m * ldo + n] = hsum256(acc[m]) + ymin[m] + (L->bias ? L->bias[n] : 0.f);
    }
}

/* int4 weight-only at one token on AVX2 (csrc/gemv_avx512.h's int4_row_m1_avx512 in 8 lanes): a 32-byte chunk of a
 * row (64 weights, 2 blocks of 32) read as 8 int32 lanes holds 8 nibble fields per lane. Fields 2k and 2k + 1 come
 * from the lanes shifted down by 8k against the masks 0xF and 0xF0 (q and 16 q: exact as floats; field 7 is the
 * shift by 28 alone), against x staged once per call in the same order by int4_stage_m1_avx2, its odd fields
 * pre-scaled by 1/16 (exact). Per 64 weights a load, 4 shifts, 7 ands, 8 conversions, 8 multiply-adds, one permute
 * picking the lanes' group scales from a window of 8 groups' and one multiply-add: one shuffle where int4_row_avx2
 * takes 12 (its widening moves), and independent chains where its group sums were one chain of four dependent FMAs
 * per 32 weights (bound by their latency: a 1B model's int4 decode streamed 6.4 GB/s on a 2-core AVX2 EPYC). The
 * mins join once per row through the groups' sums of x (xg, zero to a multiple of 8 groups). */
INLINE void int4_stage_m1_avx2(float *xp, float *xg, const float *x, int64_t K, int64_t Kp, int64_t G) {
    const int64_t nchunks = (Kp + 63) / 64, ng = Kp / G;
    for (int64_t c = 0; c < nchunks; c++)
        for (int f = 0; f < 8; f++) {
            const float sc = f % 2 && f < 7 ? 1.f / 16.f : 1.f;
            for (int j = 0; j < 8; j++) {
                const int64_t k = 64 * c + 32 * (j / 4) + 16 * (f & 1) + 4 * (j % 4) + f / 2;
                xp[(c * 8 + f) * 8 + j] = k < K ? x[k] * sc : 0.f;
            }
        }
    for (int64_t g = 0; g < (ng + 7) / 8 * 8; g++) {
        float t = 0.f;
        if (g < ng)
            for (int64_t k = g * G; k < (g + 1) * G && k < K; k++) t += x[k];
        xg[g] = t;
    }
}

/* cnt (1..8) half floats (bf16, or f16 where f16) from p as 8 floats, zero past cnt (no read past p + cnt). */
INLINE __m256 halves8(const uint16_t *p, int f16, int cnt) {
    __m128i h;
    if (cnt >= 8) h = _mm_loadu_si128((const __m128i *)p);
    else {
        uint16_t t[8] = {0};
        memcpy(t, p, (size_t)cnt * 2);
        h = _mm_loadu_si128((const __m128i *)t);
    }
    return f16 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* cnt (1..8) floats from p, zero past cnt. */
INLINE __m256 floats8(const float *p, int cnt) {
    if (cnt >= 8) return _mm256_loadu_ps(p);
    float t[8] = {0.f};
    memcpy(t, p, (size_t)cnt * 4);
    return _mm256_loadu_ps(t);
}

/* One row (two rows a pass, each x load serving both, ran 1.1-1.2x faster on weights in the L3 but 0.7x from
 * memory on the AVX2 EPYC: two streams a thread, as its float rows found). */
INLINE void int4_row_m1_avx2(float *out, const float *xp, const float *xg, const Layer *L, int64_t n) {
    const int64_t Kp = L->Kv, G = L->G, ng = Kp / G, nbytes = Kp / 2, nchunks = (nbytes + 31) / 32;
    const uint8_t *w = (const uint8_t *)L->w + n * nbytes;
    const uint16_t *scale = (const uint16_t *)L->scale + n * ng;
    const int shift = __builtin_ctzll((uint64_t)(G / 32)); /* 32-weight blocks per group, log2 */
    __m256i idx[4]; /* chunk u of a window: lanes 0-3 its first block's group, 4-7 its second's */
    for (int u = 0; u < 4; u++) {
        const int a = (2 * u) >> shift, b = (2 * u + 1) >> shift;
        idx[u] = _mm256_setr_epi32(a, a, a, a, b, b, b, b);
    }
    const __m256i m0 = _mm256_set1_epi32(0xF), m1 = _mm256_set1_epi32(0xF0);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t c = 0;
    for (int64_t sb = 0; c < nchunks; sb++) {
        const int64_t g0 = (8 * sb) >> shift;
        const __m256 win = halves8(scale + g0, L->f16, ng - g0 < 8 ? (int)(ng - g0) : 8);
        for (int u = 0; u < 4 && c < nchunks; u++, c++) {
            const __m128i *wc = (const __m128i *)(w + c * 32); /* (a last half chunk: its upper lanes' codes 0) */
            const __m256i wv = nbytes - c * 32 >= 32 ? _mm256_loadu_si256((const __m256i *)wc)
                                                     : _mm256_set_m128i(_mm_setzero_si128(), _mm_loadu_si128(wc));
            const float *xc = xp + c * 64;
            /* (two masks for all eight fields: seven masks in place ran GCC out of registers, and it rebuilt four
             * in the loop, three instructions each) */
            const __m256i v1 = _mm256_srli_epi32(wv, 8), v2 = _mm256_srli_epi32(wv, 16);
            const __m256i v3 = _mm256_srli_epi32(wv, 24);
#define LO(v) _mm256_cvtepi32_ps(_mm256_and_si256(v, m0))
#define HI(v) _mm256_cvtepi32_ps(_mm256_and_si256(v, m1))
            __m256 t0 = _mm256_mul_ps(LO(wv), _mm256_loadu_ps(xc));
            __m256 t1 = _mm256_mul_ps(HI(wv), _mm256_loadu_ps(xc + 8));
            t0 = _mm256_fmadd_ps(LO(v1), _mm256_loadu_ps(xc + 16), t0);
            t1 = _mm256_fmadd_ps(HI(v1), _mm256_loadu_ps(xc + 24), t1);
            t0 = _mm256_fmadd_ps(LO(v2), _mm256_loadu_ps(xc + 32), t0);
            t1 = _mm256_fmadd_ps(HI(v2), _mm256_loadu_ps(xc + 40), t1);
            t0 = _mm256_fmadd_ps(LO(v3), _mm256_loadu_ps(xc + 48), t0);
            t1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(wv, 28)), _mm256_loadu_ps(xc + 56), t1);
#undef LO
#undef HI
            const __m256 sv = _mm256_permutevar8x32_ps(win, idx[u]);
            if (u & 1) acc1 = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), sv, acc1);
            else acc0 = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), sv, acc0);
        }
    }
    for (int64_t g0 = 0; g0 < ng; g0 += 8) {
        const int cnt = ng - g0 < 8 ? (int)(ng - g0) : 8;
        const __m256 mv = L->sym ? _mm256_mul_ps(halves8(scale + g0, L->f16, cnt), _mm256_set1_ps(-8.f))
                        : L->f32mins ? floats8((const float *)L->mins + n * ng + g0, cnt)
                                     : halves8((const uint16_t *)L->mins + n * ng + g0, L->f16, cnt);
        acc0 = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xg + g0), acc0);
    }
    out[n] = hsum256(_mm256_add_ps(acc0, acc1)) + (L->bias ? L->bias[n] : 0.f);
}
/* (gemv.c's one-token int4 dispatch: weights per chunk, the staging, the row) */
#define INT4_M1_CHUNK 64
#define INT4_M1_STAGE int4_stage_m1_avx2
#define INT4_M1_ROW int4_row_m1_avx2

/* int8 weight-only on AVX2: 8 codes widened and converted per vector (the 64-byte v16 path of int8_row compiled
 * to 3 tok/s on a 1B shape), each reused for the M rows of x, the row's scale applied once at the end. */
INLINE void int8_row_avx2(float *out, int64_t ldo, const float *x, int M, const Layer *L, int64_t n) {
    const int64_t K = L->K;
    const int8_t *w = (const int8_t *)L->w + n * K;
    __m256 a0[MB], a1[MB];
    for (int m = 0; m < M; m++) a0[m] = a1[m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(w + k));
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
        for (int m = 0; m < M; m++) {
            a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * L->Kv + k), a0[m]);
            a1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * L->Kv + k + 8), a1[m]);
        }
    }
    const float sc = ((const float *)L->scale)[n];
    for (int m = 0; m < M; m++) {
        float s = hsum256(_mm256_add_ps(a0[m], a1[m]));
        for (int64_t j = k; j < K; j++) s += x[m * L->Kv + j] * (float)w[j];
        out[m * ldo + n] = s * sc + (L->bias ? L->bias[n] : 0.f);
    }
}

/* 8 float weights of a row: float32, or bfloat16 bits widened (a float's upper half). */
INLINE __m256 dense8(const Layer *L, int bf16, int64_t n, int64_t k) {
    if (!bf16) return _mm256_loadu_ps((const float *)L->w + n * L->K + k);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)L->w + n * L->K + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Float weights (f32 or bf16), R rows from n against M tokens (R * M <= 8): every accumulator in a register, each
 * x load serving the R rows, one transposed reduction for all R * M sums. The generic rows (dense_row) use
 * 64-byte vectors, two registers each here: with 2 x MB of them they spilled every iteration, and the native
 * kernel ran 5-10x slower than oneDNN from 4 tokens up, so a batch-1 verification of a few proposals (2-7 rows)
 * left the decode stack. */
INLINE void dense_rows_avx2(float *out, int64_t ldo, const float *x, const int M, const int R, const Layer *L,
                            int bf16, int64_t n) {
    const int64_t K = L->K;
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 w[4];
        for (int r = 0; r < R; r++) w[r] = dense8(L, bf16, n + r, k);
        for (int m = 0; m < M; m++) {
            const __m256 xv = _mm256_loadu_ps(x + m * L->Kv + k);
            for (int r = 0; r < R; r++) acc[r * M + m] = _mm256_fmadd_ps(w[r], xv, acc[r * M + m]);
        }
    }
    float s[8];
    _mm256_storeu_ps(s, hsum8x8(acc));
    dense_rows_store(out, ldo, x, M, R, L, bf16, n, k, s);
}

/* This thread's share of N against M (2..16) tokens: 8 tokens a pass from the first, 4 rows a pass at 2 tokens, 2
 * at 3-4 (at least 6 independent accumulator chains: an FMA's latency is 4 of its throughput-0.5 cycles). */
INLINE void dense_all_avx2(float *out, int64_t ldo, const float *x, int M, const Layer *L, int bf16, int64_t N) {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t end = N * (t + 1) / nt;
    for (int j = 0; j < M; j += 8) {
        const int mt = M - j < 8 ? M - j : 8, R = mt <= 2 ? 4 : mt <= 4 ? 2 : 1;
        float *o = out + j * ldo;
        const float *xj = x + j * L->Kv;
        for (int64_t n = N * t / nt; n < end;) {
#define DENSE_R(c) dense_rows_avx2(o, ldo, xj, c, (c) <= 2 ? 4 : (c) <= 4 ? 2 : 1, L, bf16, n)
#define DENSE_1(c) dense_rows_avx2(o, ldo, xj, c, 1, L, bf16, n)
            if (n + R > end) { /* the share's last rows, one at a time */
                SWITCH_M8(mt, DENSE_1);
                n++;
                continue;
            }
            SWITCH_M8(mt, DENSE_R);
#undef DENSE_R
#undef DENSE_1
            n += R;
        }
    }
}

/* W8A8 on AVX2, one weight row against M (1..8) tokens, 32 weights at a time (s8_dot32_acc, csrc/gemv.c); the int32
 * accumulators stay in registers and are reduced for all M at once by horizontal adds
 * (four tokens per pass, each reduced alone through memory, put a quarter of a 576-wide row's instructions
 * in its reductions). Exact: the integer sums, then xs * scale as before. */
INLINE void w8a8_row_avx2(float *out, int64_t ldo, const int8_t *xq, const float *xs, const int M, const Layer *L,
                          int64_t n) {
    const int64_t K = L->K;
    const int8_t *w = (const int8_t *)L->w + n * K;
    __m256i acc[8];
    for (int m = 0; m < 8; m++) acc[m] = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k)), wa = _mm256_sign_epi8(wv, wv);
        for (int m = 0; m < M; m++) acc[m] = s8_dot32_acc(acc[m], wa, wv, xq + m * L->Kv + k);
    }
    int32_t sums[8];
    _mm256_storeu_si256((__m256i *)sums, hsum8x8_epi32(acc));
    const float sc = ((const float *)L->scale)[n];
    for (int m = 0; m < M; m++) {
        int64_t s = sums[m];
        for (int64_t j = k; j < K; j++) s += (int32_t)xq[m * L->Kv + j] * w[j];
        out[m * ldo + n] = (float)s * xs[m] * sc + (L->bias ? L->bias[n] : 0.f);
    }
}

/* This thread's share of N, each row against all M tokens, 8 per pass (inside an omp parallel region). */
static inline void w8a8_rows_avx2(float *out, int64_t ldo, const int8_t *xq, const float *xs, int M, const Layer *L,
                                  int64_t N) {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    for (int64_t n = N * t / nt; n < N * (t + 1) / nt; n++)
        for (int j = 0; j < M; j += 8) {
            float *o = out + j * ldo;
            const int8_t *x = xq + j * L->Kv;
#define W8A8_ROW(c) w8a8_row_avx2(o, ldo, x, xs + j, c, L, n)
            SWITCH_M8(M - j < 8 ? M - j : 8, W8A8_ROW);
#undef W8A8_ROW
        }
}
#define GEMV_AVX2 1
#endif

#endif
