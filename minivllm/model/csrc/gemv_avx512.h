/* csrc/gemv.c's rows on AVX-512: float weights (f32, bf16) for 2..16 tokens, int4 weight-only for 1..4 tokens (one
 * token: its own rows), and with VNNI W8A8 at one token; included there after Layer. */
#ifndef MINIVLLM_GEMV_AVX512_H
#define MINIVLLM_GEMV_AVX512_H

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include "hsum_avx2.h"

/* 16 float weights of a row: float32, or bfloat16 bits widened (a float's upper half). */
INLINE __m512 dense16(const Layer *L, int bf16, int64_t n, int64_t k) {
    if (!bf16) return _mm512_loadu_ps((const float *)L->w + n * L->K + k);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)L->w + n * L->K + k));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Float weights, R rows from n against M tokens (R * M <= 16): every accumulator in a register (32 of them here:
 * 16 sums, R weights, one x), each x load serving the R rows, each weight load the M tokens; the sums reduced
 * together (halves added, then csrc/hsum_avx2.h's transposes). The generic rows (dense_row) take one weight row
 * and 4 tokens a pass and reduce every sum alone, 16 scalar adds: on a Xeon with AVX-512 a 5-row verification of
 * the 12M model cost 2.3x its one-row step (5.2 ms against 2.3) where the weights are read about once.
 * From 4 tokens on, the next pass's R rows are prefetched as this pass reads its own: each weight then meets 4-16
 * FMAs and the core, busy with them, left the hardware prefetcher behind (a mixture's experts, 1536 x 1024 and
 * 1024 x 768 from memory, 2 threads, a Zen 4 EPYC, same-process A/B: 8 tokens 10 -> 15 GB/s, 1.36-1.48x at 6-10
 * tokens, 1.24x at 16, bfloat16 1.4-1.8x; 1B-shaped 1.3-1.4x; at 2-3 tokens, 8 or 5 rows a pass, no change). */
INLINE void dense_rows_avx512(float *out, int64_t ldo, const float *x, const int M, const int R, const Layer *L,
                              int bf16, int64_t n) {
    const int64_t K = L->K;
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 w[8];
        if (M >= 4) /* the next pass's rows (a prefetch past the matrix's end does not fault) */
            for (int r = 0; r < R; r++)
                _mm_prefetch((const char *)L->w + ((n + R + r) * K + k) * (bf16 ? 2 : 4), _MM_HINT_T0);
        for (int r = 0; r < R; r++) w[r] = dense16(L, bf16, n + r, k);
        for (int m = 0; m < M; m++) {
            const __m512 xv = _mm512_loadu_ps(x + m * L->Kv + k);
            for (int r = 0; r < R; r++) acc[r * M + m] = _mm512_fmadd_ps(w[r], xv, acc[r * M + m]);
        }
    }
    __m256 half[16];
    const int used = R * M;
    for (int i = 0; i < used; i++)
        half[i] = _mm256_add_ps(_mm512_castps512_ps256(acc[i]),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i]), 1)));
    for (int i = used; i < 16; i++) half[i] = _mm256_setzero_ps();
    float s[16];
    _mm256_storeu_ps(s, hsum8x8(half));
    if (used > 8) _mm256_storeu_ps(s + 8, hsum8x8(half + 8));
    dense_rows_store(out, ldo, x, M, R, L, bf16, n, k, s);
}

/* One float weight row against M (1..FEW_ROWS_MAX_M) tokens, the row whole before the next: one sequential weight
 * stream per thread, K unrolled by 4 so that 2 tokens still have 8 independent FMA chains. The passes below read 8
 * (2 tokens), 5 (3) or 4 (4) rows a pass, that many interleaved streams, which on a 2-vCPU Zen 4 EPYC starved the
 * hardware prefetcher for short rows as they did at one token: a verification of 2 rows of the 12M model (384-
 * and 1024-float rows) cost 1.8x its one-row step. Over distinct 384-float rows from memory (2 threads, medians of
 * 7 alternating rounds) one by one read 1.24-1.35x as fast at 2-4 tokens, 576-float rows 1.05-1.2x, 1024 tied,
 * 1536 and 2048 lost (0.6-0.9x: each x load serves one row, not R, and x no longer sits in L1 beside the stream);
 * at 5-8 tokens neither order won throughout. So which rows go this way is a length (gemv_few_rows_k, gemv.c),
 * timed at start-up (model/row_order.py). */
#define FEW_ROWS_MAX_M 4
INLINE void dense_row1_avx512(float *out, int64_t ldo, const float *x, const int M, const Layer *L, int bf16,
                              int64_t n) {
    const int64_t K = L->K;
    enum { U = 4 };
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 * U <= K; k += 16 * U)
        for (int u = 0; u < U; u++) {
            const __m512 w = dense16(L, bf16, n, k + 16 * u);
            for (int m = 0; m < M; m++)
                acc[u * M + m] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + m * L->Kv + k + 16 * u), acc[u * M + m]);
        }
    for (; k + 16 <= K; k += 16) {
        const __m512 w = dense16(L, bf16, n, k);
        for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + m * L->Kv + k), acc[m]);
    }
    float s[FEW_ROWS_MAX_M];
    for (int m = 0; m < M; m++) {
        __m512 t = acc[m];
        for (int u = 1; u < U; u++) t = _mm512_add_ps(t, acc[u * M + m]);
        s[m] = _mm512_reduce_add_ps(t);
    }
    dense_rows_store(out, ldo, x, M, 1, L, bf16, n, k, s);
}

/* Weight rows a pass at mt tokens: as many as keep R * mt <= 16 sums, 8 at most (at least 8 independent FMA
 * chains from 3 tokens up; 5 tokens 3 rows a pass, not 2: 8 loads per 15 FMAs, not 7 per 10). */
#define ROWS_FOR(mt) ((mt) <= 2 ? 8 : 16 / (mt))

/* Rows [n0, end) against M (2..16) tokens, 8 tokens a pass. From 9 tokens the rows are the outer loop:
 * two rows against the first 8 tokens, then the same two rows (in L1 now) against the rest, so the weights stream
 * from memory once, not once per 8 tokens. Same-process A/B against the token-block-outer order (8 alternating
 * passes over distinct weights, 2 threads, an Intel Xeon): 1.18-1.34x at 9-16 tokens on 1B-shaped projections
 * (3072x2048 ... 2048x8192), 1.05-1.15x on a mixture's experts (1536x1024, 1024x768). */
INLINE void dense_span_avx512(float *out, int64_t ldo, const float *x, int M, const Layer *L, int bf16, int64_t n0,
                              int64_t end, int one) {
    if (one) { /* (M <= FEW_ROWS_MAX_M: the caller's test) */
        for (int64_t n = n0; n < end; n++) {
            if (M == 2) dense_row1_avx512(out, ldo, x, 2, L, bf16, n);
            else if (M == 3) dense_row1_avx512(out, ldo, x, 3, L, bf16, n);
            else dense_row1_avx512(out, ldo, x, 4, L, bf16, n);
        }
        return;
    }
    if (M > 8) {
        const int rest = M - 8;
        float *o2 = out + 8 * ldo;
        const float *x2 = x + 8 * L->Kv;
        for (int64_t n = n0; n < end;) {
#define REST_2(c) dense_rows_avx512(o2, ldo, x2, c, 2, L, bf16, n)
#define REST_1(c) dense_rows_avx512(o2, ldo, x2, c, 1, L, bf16, n)
            if (n + 2 > end) { /* the share's last row */
                dense_rows_avx512(out, ldo, x, 8, 1, L, bf16, n);
                SWITCH_M8(rest, REST_1);
                n++;
                continue;
            }
            dense_rows_avx512(out, ldo, x, 8, 2, L, bf16, n);
            SWITCH_M8(rest, REST_2);
#undef REST_2
#undef REST_1
            n += 2;
        }
        return;
    }
    for (int j = 0; j < M; j += 8) {
        const int mt = M - j < 8 ? M - j : 8, R = ROWS_FOR(mt);
        float *o = out + j * ldo;
        const float *xj = x + j * L->Kv;
        for (int64_t n = n0; n < end;) {
#define DENSE_R(c) dense_rows_avx512(o, ldo, xj, c, ROWS_FOR(c), L, bf16, n)
#define DENSE_1(c) dense_rows_avx512(o, ldo, xj, c, 1, L, bf16, n)
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

/* All rows against M (2..16) tokens, as the queue q hands them to the threads of the enclosing region
 * (csrc/gemv_rows.h's rq_take): fixed halves left the faster vCPU waiting (1.0-1.12x at 4-12 tokens here). */
INLINE void dense_all_avx512(float *out, int64_t ldo, const float *x, int M, const Layer *L, int bf16,
                             row_queue_t *q, int one) {
    int64_t n0, end;
    while (rq_take(q, &n0, &end)) dense_span_avx512(out, ldo, x, M, L, bf16, n0, end, one);
}

#define GEMV_DENSE_AVX512 1

/* Up to 16 group scales or mins from g0 (cnt of them; zeros past): bfloat16 or (f16) float16 bits widened. */
#include "group_window.h"
INLINE __m512 int4_halves16(const uint16_t *p, int f16, __mmask16 cnt) {
    return half16(_mm256_maskz_loadu_epi16(cnt, p), f16);
}

/* Chunk c (64 bytes: 128 weights, 4 blocks) of an int4 row of nbytes; a partial last chunk's missing lanes read as
 * zero codes (they meet zero x). */
INLINE __m512i int4_chunk(const uint8_t *row, int64_t nbytes, int64_t c) {
    const int64_t left = nbytes - c * 64;
    return left >= 64 ? _mm512_loadu_si512((const void *)(row + c * 64))
                      : _mm512_maskz_loadu_epi32((__mmask16)((1u << (left / 4)) - 1), row + c * 64);
}

/* The one-token int4 rows that read R rows a pass in W4A8's order (csrc/gemv_int4_bf16dot.h, gemv_int4_int16dot.h):
 * chunk c's prefetch of the pass after next (as many bytes as this pass reads, two passes ahead; into L2 with l2). */
INLINE void int4_prefetch_pass(const uint8_t *w, int64_t nbytes, int64_t c, int R, int l2) {
    for (int r = 0; r < R; r++) {
        const uint8_t *p = w + 2 * R * nbytes + c * 64 * R + r * 64;
        if (l2) __builtin_prefetch(p, 0, 2);
        else __builtin_prefetch(p);
    }
}

/* ... and their groups' mins against x's group sums xg (zero past ng): acc[r] += (min + extra * scale) . xg for rows
 * n..n+R-1 (extra: what the rows' codes carry beyond q, times the scale; -16 for the bf16 rows' 16 + q). */
INLINE void int4_rows_add_mins(__m512 *acc, const Layer *L, int64_t n, int R, const float *xg, float extra) {
    const int64_t ng = L->Kv / L->G;
    const uint16_t *scale = (const uint16_t *)L->scale + n * ng;
    for (int64_t g0 = 0; g0 < ng; g0 += 16) {
        const int cnt = ng - g0 < 16 ? (int)(ng - g0) : 16;
        const __mmask16 mk = (__mmask16)((1u << cnt) - 1);
        const __m512 xgv = _mm512_loadu_ps(xg + g0);
        for (int r = 0; r < R; r++) {
            const __m512 sv = int4_halves16(scale + r * ng + g0, L->f16, mk);
            const __m512 mv = L->sym       ? _mm512_mul_ps(sv, _mm512_set1_ps(-8.f))
                            : L->f32mins ? _mm512_maskz_loadu_ps(mk, (const float *)L->mins + (n + r) * ng + g0)
                                         : int4_halves16((const uint16_t *)L->mins + (n + r) * ng + g0, L->f16, mk);
            acc[r] = _mm512_fmadd_ps(extra != 0.f ? _mm512_fmadd_ps(sv, _mm512_set1_ps(extra), mv) : mv, xgv, acc[r]);
        }
    }
}

/* int4 weight-only against M (1..4) float tokens, x zero-padded to Kp = Kv. Each group's 16 possible weights,
 * scale * q + min, are a table the codes index: vpermps reads only an index's low 4 bits, so 16 codes widened
 * to int32 lanes pick their weights with no mask, no int-to-float conversion and no per-weight scale or min (6
 * instructions per 32 weights: widen, shift, two permutes, two FMAs; the AVX2 rows take 15 at half the width). The
 * group's scales and mins are loaded 16 at a time and each broadcast from its lane. */
INLINE void int4_row_avx512(float *out, int64_t ldo, const float *x, const int M, const Layer *L, int64_t n) {
    const int64_t Kp = L->Kv, G = L->G, ng = Kp / G;
    const uint8_t *w = (const uint8_t *)L->w + n * (Kp / 2);
    const uint16_t *scale = (const uint16_t *)L->scale + n * ng;
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 a0[4], a1[4];
    for (int m = 0; m < M; m++) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < ng; g0 += 16) {
        const int cnt = ng - g0 < 16 ? (int)(ng - g0) : 16;
        const __mmask16 mk = (__mmask16)((1u << cnt) - 1);
        const __m512 sv = int4_halves16(scale + g0, L->f16, mk);
        const __m512 mv = L->sym ? _mm512_mul_ps(sv, _mm512_set1_ps(-8.f))
                        : L->f32mins ? _mm512_maskz_loadu_ps(mk, (const float *)L->mins + n * ng + g0)
                                     : int4_halves16((const uint16_t *)L->mins + n * ng + g0, L->f16, mk);
        for (int gi = 0; gi < cnt; gi++) {
            const __m512i lane = _mm512_set1_epi32(gi);
            const __m512 table =
                _mm512_fmadd_ps(iota, _mm512_permutexvar_ps(lane, sv), _mm512_permutexvar_ps(lane, mv));
            for (int64_t k = (g0 + gi) * G, end = k + G; k < end; k += 32) {
                const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + k / 2)));
                const __m512 lo = _mm512_permutexvar_ps(b, table);
                const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
                for (int m = 0; m < M; m++) {
                    a0[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + m * Kp + k), a0[m]);
                    a1[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + m * Kp + k + 16), a1[m]);
                }
            }
        }
    }
    for (int m = 0; m < M; m++)
        out[m * ldo + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m])) + (L->bias ? L->bias[n] : 0.f);
}
#define GEMV_INT4_AVX512 1

/* int4 weight-only at one token, with no shuffle per weight: a 64-byte chunk of a row (128 weights, 4 blocks of 32)
 * read as 16 int32 lanes holds 8 nibble fields per lane. Field f masked in place is q * 16^f, an integer of at most
 * 4 significant bits, so it converts to float exactly, and x's entries for that field come pre-scaled by 16^-f
 * (a power of two: exact), staged once per call by int4_stage_m1; field 7 is shifted down instead (the sign bit).
 * Per 128 weights: 7 ands, a shift, 8 conversions, 8 multiply-adds, then the lanes' group scales (a window of 16
 * groups' scales, one permute per chunk as in csrc/gemv_w4a8.c) and one multiply-add; the mins join once per row
 * through each group's sum of x. The table kernel above spends 5 shuffles per 32 weights on the one shuffle port.
 * xp: int4_stage_m1's layout; xg: per-group sums of x, zero to a multiple of 16 groups. */
INLINE void int4_stage_m1(float *xp, float *xg, const float *x, int64_t K, int64_t Kp, int64_t G) {
    const int64_t nchunks = (Kp + 127) / 128, ng = Kp / G;
    for (int64_t c = 0; c < nchunks; c++)
        for (int f = 0; f < 8; f++) {
            const float sc = f == 7 ? 1.f : 1.f / (float)(1 << (4 * f));
            for (int j = 0; j < 16; j++) {
                const int64_t k = 128 * c + 32 * (j / 4) + 16 * (f & 1) + 4 * (j % 4) + f / 2;
                xp[(c * 8 + f) * 16 + j] = k < K ? x[k] * sc : 0.f;
            }
        }
    for (int64_t g = 0; g < (ng + 15) / 16 * 16; g++) {
        float t = 0.f;
        if (g < ng)
            for (int64_t k = g * G; k < (g + 1) * G && k < K; k++) t += x[k];
        xg[g] = t;
    }
}

INLINE void int4_row_m1_avx512(float *out, const float *xp, const float *xg, const Layer *L, int64_t n) {
    const int64_t Kp = L->Kv, G = L->G, ng = Kp / G, nbytes = Kp / 2, nchunks = (Kp + 127) / 128;
    const uint8_t *w = (const uint8_t *)L->w + n * nbytes;
    const uint16_t *scale = (const uint16_t *)L->scale + n * ng;
    const int shift = __builtin_ctzll((uint64_t)(G / 32)); /* 32-weight blocks per group, log2 */
    __m512i idx[4];
    window_index(idx, shift);
    __m512 acc = _mm512_setzero_ps();
    int64_t c = 0;
    for (int64_t sb = 0; c < nchunks; sb++) {
        const int64_t g0 = (16 * sb) >> shift;
        const int cnt = ng - g0 < 16 ? (int)(ng - g0) : 16;
        const __m512 win = int4_halves16(scale + g0, L->f16, (__mmask16)((1u << cnt) - 1));
        for (int u = 0; u < 4 && c < nchunks; u++, c++) {
            const __m512i wv = int4_chunk(w, nbytes, c);
            const float *xc = xp + c * 128;
#define FIELD(f) _mm512_cvtepi32_ps(_mm512_and_si512(wv, _mm512_set1_epi32(0xF << (4 * (f)))))
            __m512 t0 = _mm512_mul_ps(FIELD(0), _mm512_loadu_ps(xc));
            __m512 t1 = _mm512_mul_ps(FIELD(1), _mm512_loadu_ps(xc + 16));
            t0 = _mm512_fmadd_ps(FIELD(2), _mm512_loadu_ps(xc + 32), t0);
            t1 = _mm512_fmadd_ps(FIELD(3), _mm512_loadu_ps(xc + 48), t1);
            t0 = _mm512_fmadd_ps(FIELD(4), _mm512_loadu_ps(xc + 64), t0);
            t1 = _mm512_fmadd_ps(FIELD(5), _mm512_loadu_ps(xc + 80), t1);
            t0 = _mm512_fmadd_ps(FIELD(6), _mm512_loadu_ps(xc + 96), t0);
            t1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(wv, 28)), _mm512_loadu_ps(xc + 112), t1);
#undef FIELD
            acc = _mm512_fmadd_ps(_mm512_add_ps(t0, t1), _mm512_permutexvar_ps(idx[u], win), acc);
        }
    }
    for (int64_t g0 = 0; g0 < ng; g0 += 16) {
        const int cnt = ng - g0 < 16 ? (int)(ng - g0) : 16;
        const __mmask16 mk = (__mmask16)((1u << cnt) - 1);
        __m512 mv = L->sym        ? _mm512_mul_ps(int4_halves16(scale + g0, L->f16, mk), _mm512_set1_ps(-8.f))
                  : L->f32mins ? _mm512_maskz_loadu_ps(mk, (const float *)L->mins + n * ng + g0)
                               : int4_halves16((const uint16_t *)L->mins + n * ng + g0, L->f16, mk);
        acc = _mm512_fmadd_ps(mv, _mm512_loadu_ps(xg + g0), acc);
    }
    out[n] = _mm512_reduce_add_ps(acc) + (L->bias ? L->bias[n] : 0.f);
}
/* (gemv.c's one-token int4 dispatch: weights per chunk, the staging, the row) */
#define INT4_M1_CHUNK 128
#define INT4_M1_STAGE int4_stage_m1
#define INT4_M1_ROW int4_row_m1_avx512
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* W8A8 at one token, R (1, 2 or 4) weight rows from n: vpdpbusd takes one unsigned operand, so each weight byte is
 * flipped to w + 128 (one xor) and 128 * sum(x), summed once per call, comes off the total: exact. One vpdpbusd per
 * 64 weights of a row where the 256-bit rows (w8a8_row_avx2) take two sign moves and a vpdpbusd per 32; the x load
 * serves the R rows. Past K, masked loads give zero x (and 128 for w: products of zero). */
INLINE void w8a8_rows_m1_vnni(float *out, const int8_t *xq, float xs, int32_t xsum, const Layer *L, int64_t n,
                              const int R) {
    const int64_t K = L->K;
    const int8_t *w = (const int8_t *)L->w + n * K;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        const __m512i xv = _mm512_loadu_si512((const void *)(xq + k));
        for (int r = 0; r < R; r++) PREFETCH_L2(w + r * K + k, L->pf);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_dpbusd_epi32(
                acc[r], _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + r * K + k)), flip), xv);
    }
    if (k < K) {
        const __mmask64 mk = ((__mmask64)1 << (K - k)) - 1;
        const __m512i xv = _mm512_maskz_loadu_epi8(mk, xq + k);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_xor_si512(_mm512_maskz_loadu_epi8(mk, w + r * K + k), flip),
                                         xv);
    }
    const float *sc = (const float *)L->scale;
    for (int r = 0; r < R; r++) {
        const int64_t s = (int64_t)_mm512_reduce_add_epi32(acc[r]) - 128 * (int64_t)xsum;
        out[n + r] = (float)s * xs * sc[n + r] + (L->bias ? L->bias[n + r] : 0.f);
    }
}

/* This thread's rows at one token (inside an omp parallel region; as the queue q hands them out) in the order the
 * float rows take (gemv_m1_order, csrc/gemv_m1.h): four a pass, one by one, or two a pass, their loads alternating
 * line by line (w8a8_rows_m1_vnni with R = 2). The same interleaved short streams: on the Zen 4 EPYC that chose one
 * by one the W8A8 decode stack ran 1.71x (135M, 576-byte rows) and 1.33x (1B) as fast as four a pass. */
INLINE void w8a8_m1_vnni(float *out, const int8_t *xq, float xs, int32_t xsum, const Layer *L, row_queue_t *q,
                         int order) {
    int64_t n, end;
    while (rq_take(q, &n, &end)) {
        if (order == M1_PASS)
            for (; n + 4 <= end; n += 4) w8a8_rows_m1_vnni(out, xq, xs, xsum, L, n, 4);
        else if (order == M1_PAIRS)
            for (; n + 2 <= end; n += 2) w8a8_rows_m1_vnni(out, xq, xs, xsum, L, n, 2);
        for (; n < end; n++) w8a8_rows_m1_vnni(out, xq, xs, xsum, L, n, 1);
    }
}
#define GEMV_W8A8_M1_VNNI 1
#endif

#endif
