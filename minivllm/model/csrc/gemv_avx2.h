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

/* int4 on AVX2 for 2..MAX_M tokens (one token: int4_rows_m1_avx2 below): 16-entry tables need two 8-lane permutes
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

/* int4 weight-only at one token on AVX2: x in int16, one scale per 32-weight block. Without VNNI, float x against
 * nibbles costs a conversion per 8 weights (the nibble-field rows this replaced: ~30 vector instructions per 64
 * weights, 4-7.6 GB/s a core from the L3 on the AVX2 EPYC). With x as int16, `vpmaddwd` takes 16 code * x products
 * an instruction into int32: per 64 weights (a 32-byte chunk, two blocks of 32: byte i of a block holds its weights
 * i and i + 16) a load, a shift, two ands, four byte unpacks against zero, four multiply-adds, three adds, one
 * conversion, a permute picking the two blocks' group scales from a window of 8 groups', a multiply by x's two
 * block scales and one multiply-add: 19. x's rounding: at most 2^-16 of its block's largest magnitude per element,
 * 128x finer than a bfloat16 model's activations (2^-9 relative); the groups' sums of x that meet the mins are
 * taken from the same rounded x, so the row is exactly x's int16 image against the dequantized weights.
 * Staged per chunk c at xp + 64 c (floats): 64 int16 in the unpacks' order (vector t, lane p: block p / 8,
 * weight 8 t + p % 8), then 8 floats: block A's scale in lanes 0-3, block B's in 4-7 (vpmaddwd's int32 lanes
 * 0-3 sum block A's products, 4-7 block B's). xg: the groups' sums, zero to a multiple of 8 groups. */
INLINE void int4_stage_m1_avx2(float *xp, float *xg, const float *x, int64_t K, int64_t Kp, int64_t G) {
    const int64_t nchunks = (Kp + 63) / 64, ng = Kp / G;
    for (int64_t g = 0; g < (ng + 7) / 8 * 8; g++) xg[g] = 0.f;
    for (int64_t c = 0; c < nchunks; c++) {
        int16_t *q = (int16_t *)(xp + c * 64);
        float *sc = xp + c * 64 + 32;
        for (int b = 0; b < 2; b++) {
            const int64_t k0 = 64 * c + 32 * b, nk = K - k0 < 32 ? (K - k0 > 0 ? K - k0 : 0) : 32;
            float amax = 0.f;
            int32_t sum = 0;
            if (nk == 32) { /* a whole block in vectors (cvtps rounds to nearest even, as nearbyintf) */
                const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
                __m256 v[4], m = _mm256_setzero_ps();
                for (int t = 0; t < 4; t++) {
                    v[t] = _mm256_loadu_ps(x + k0 + 8 * t);
                    m = _mm256_max_ps(m, _mm256_and_ps(v[t], sign));
                }
                __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
                h = _mm_max_ps(h, _mm_movehl_ps(h, h));
                amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
                const __m256 inv = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
                __m256i acc = _mm256_setzero_si256();
                for (int t = 0; t < 4; t++) { /* weights 8t..8t+7: lanes 8b.. of vector t */
                    const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], inv));
                    acc = _mm256_add_epi32(acc, r);
                    _mm_storeu_si128((__m128i *)(q + 16 * t + 8 * b),
                                     _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
                }
                __m128i a = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
                a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4E));
                sum = _mm_cvtsi128_si32(_mm_add_epi32(a, _mm_shuffle_epi32(a, 0xB1)));
            } else { /* the last block, past K: scalar */
                for (int64_t i = 0; i < nk; i++) amax = fmaxf(amax, fabsf(x[k0 + i]));
                const float inv = amax > 0.f ? 32767.f / amax : 0.f;
                for (int i = 0; i < 32; i++) {
                    const int32_t v = i < nk ? (int32_t)nearbyintf(x[k0 + i] * inv) : 0;
                    q[(i / 8) * 16 + 8 * b + i % 8] = (int16_t)v;
                    sum += v;
                }
            }
            const float s = amax / 32767.f;
            for (int j = 0; j < 4; j++) sc[4 * b + j] = s;
            if (k0 < Kp) xg[k0 / G] += (float)sum * s;
        }
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

/* A chunk's 32 bytes (64 weights, two blocks) against x's staged int16 (xq, int4_stage_m1_avx2's layout): 8 int32
 * sums as float, lanes 0-3 the first block's, 4-7 the second's. */
INLINE __m256 int4_chunk_avx2(__m256i wv, const __m256i *xq) {
    const __m256i nib = _mm256_set1_epi8(0x0F), z = _mm256_setzero_si256();
    const __m256i lo = _mm256_and_si256(wv, nib), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), nib);
    const __m256i p0 = _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, z), _mm256_loadu_si256(xq));
    const __m256i p1 = _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, z), _mm256_loadu_si256(xq + 1));
    const __m256i p2 = _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, z), _mm256_loadu_si256(xq + 2));
    const __m256i p3 = _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, z), _mm256_loadu_si256(xq + 3));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3)));
}

/* R (1, 2 or 4) rows from n a pass in W4A8's start-up order (gemv_w4a8_m1_order), as AVX-512's int16 rows: each
 * chunk of x and its lane scales serves the R rows. Whole windows (4 chunks, one load of 8 group scales a row) go
 * unrolled, every index a constant; the last partial window chunk by chunk. `ahead`: the rows two passes on exist,
 * whose weights are prefetched (into L1, or L2 with l2) a line a row every other chunk. */
INLINE void int4_rows_m1_avx2(float *out, const float *xp, const float *xg, const Layer *L, int64_t n, const int R,
                              int ahead, int l2) {
    const int64_t Kp = L->Kv, G = L->G, ng = Kp / G, nbytes = Kp / 2, nchunks = (nbytes + 31) / 32;
    const uint8_t *w = (const uint8_t *)L->w + n * nbytes;
    const uint16_t *scale = (const uint16_t *)L->scale + n * ng;
    const int shift = __builtin_ctzll((uint64_t)(G / 32)); /* 32-weight blocks per group, log2 */
    __m256i idx[4]; /* chunk u of a window: lanes 0-3 its first block's group, 4-7 its second's */
    for (int u = 0; u < 4; u++) {
        const int a = (2 * u) >> shift, b = (2 * u + 1) >> shift;
        idx[u] = _mm256_setr_epi32(a, a, a, a, b, b, b, b);
    }
    __m256 acc[4]; /* a row's own, one chain whatever R: every order the same bits */
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    /* the scales and mins of the pass after next (csrc/gemv_rows.h; past the last row a prefetch is a no-op) */
    prefetch_groups(L->scale, L->sym ? NULL : L->mins, n + 2 * R, R, ng, L->f32mins ? 4 : 2);
    const uint8_t *pf = w + 2 * R * nbytes; /* the pass after next: R rows, contiguous */
    int64_t c = 0;
    for (; c + 4 <= nbytes / 32; c += 4) { /* whole windows */
        const int64_t g0 = (2 * c) >> shift;
        const int cnt = ng - g0 < 8 ? (int)(ng - g0) : 8;
        __m256 win[4];
        for (int r = 0; r < R; r++) win[r] = halves8(scale + r * ng + g0, L->f16, cnt);
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) {
            if (ahead && !(u & 1))
                for (int r = 0; r < R; r++) {
                    if (l2) __builtin_prefetch(pf + (c + u) * 32 * R + r * 64, 0, 2);
                    else __builtin_prefetch(pf + (c + u) * 32 * R + r * 64);
                }
            const __m256i *xq = (const __m256i *)(xp + (c + u) * 64);
            const __m256 xs = _mm256_loadu_ps(xp + (c + u) * 64 + 32);
            for (int r = 0; r < R; r++) {
                const __m256 f = int4_chunk_avx2(_mm256_loadu_si256((const __m256i *)(w + r * nbytes + (c + u) * 32)), xq);
                const __m256 sv = _mm256_mul_ps(_mm256_permutevar8x32_ps(win[r], idx[u]), xs);
                acc[r] = _mm256_fmadd_ps(f, sv, acc[r]);
            }
        }
    }
    for (; c < nchunks; c++) { /* the last window's chunks (a half chunk last: its upper lanes' codes 0) */
        const int64_t b0 = 2 * c;
        const __m256 xs = _mm256_loadu_ps(xp + c * 64 + 32);
        for (int r = 0; r < R; r++) {
            const __m128i *wc = (const __m128i *)(w + r * nbytes + c * 32);
            const __m256i wv = nbytes - c * 32 >= 32 ? _mm256_loadu_si256((const __m256i *)wc)
                                                     : _mm256_set_m128i(_mm_setzero_si128(), _mm_loadu_si128(wc));
            const uint16_t *sr = scale + r * ng;
            const float s0 = half_to_f32(sr[b0 >> shift], L->f16);
            const float s1 = b0 + 1 < 2 * nbytes / 32 ? half_to_f32(sr[(b0 + 1) >> shift], L->f16) : 0.f;
            const __m256 sv = _mm256_mul_ps(_mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1), xs);
            acc[r] = _mm256_fmadd_ps(int4_chunk_avx2(wv, (const __m256i *)(xp + c * 64)), sv, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) { /* + min * sum(x) per group */
        for (int64_t g0 = 0; g0 < ng; g0 += 8) {
            const int cnt = ng - g0 < 8 ? (int)(ng - g0) : 8;
            const __m256 mv = L->sym ? _mm256_mul_ps(halves8(scale + r * ng + g0, L->f16, cnt), _mm256_set1_ps(-8.f))
                            : L->f32mins ? floats8((const float *)L->mins + (n + r) * ng + g0, cnt)
                                         : halves8((const uint16_t *)L->mins + (n + r) * ng + g0, L->f16, cnt);
            acc[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xg + g0), acc[r]);
        }
        out[n + r] = hsum256(acc[r]) + (L->bias ? L->bias[n + r] : 0.f);
    }
}
/* (gemv.c's one-token int4 dispatch: weights per chunk, the staging, the row) */
#define INT4_M1_CHUNK 64
#define INT4_M1_STAGE int4_stage_m1_avx2
#define INT4_M1_ROWS_AVX2 1 /* (its rows follow W4A8's order: int4_rows_m1_avx2) */
#define INT4_M1_X_INT16 1

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
