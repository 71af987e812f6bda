/*
 * int4 weight-only rows (csrc/gemv.c's format list: 32-weight blocks of nibbles, a scale and a min per group of G):
 * at one token the ISA's rows (AVX-512's float rows, or in W4A8's start-up order x as int16 by AVX2's vpmaddwd or
 * AVX512-VNNI's vpdpwssd / x as bf16 by vdpbf16ps: csrc/gemv_avx2.h, gemv_int4_int16dot.h, gemv_int4_bf16dot.h), at
 * a handful of tokens of a float32 model x as int16 too (AVX512-VNNI), at more tokens rows that reuse each group's
 * weights for all of them.
 */
#include "gemv_common.h"

/* csrc/gemv_w4a8.c: W4A8's one-token order for rows of row_bytes: rows a pass (4, 2 or 1), *l2 its prefetch's level. */
int gemv_w4a8_m1_order(int64_t row_bytes, int *l2);

/* x is zero-padded to Kp = Kv. Each group's 16 possible weights, scale * q + min, form a table the codes index
 * (one vpermps per 16 weights where AVX-512 has it): no int-to-float conversion, no scale multiply and no
 * separate min term per weight (those took 9 vector and ~6 scalar instructions per 32 weights; this takes 7). */
INLINE void int4_row(float *out, int64_t ldo, const float *x, int M, const Layer *L, int64_t n) {
    const int64_t Kp = L->Kv, G = L->G, ng = Kp / G;
    const uint8_t *w = (const uint8_t *)L->w + n * (Kp / 2);
    const uint16_t *scale = (const uint16_t *)L->scale + n * ng;
    const uint16_t *mins = L->sym ? NULL : (const uint16_t *)L->mins + n * ng; /* (no mins stored where sym) */
    const float *minf = L->sym ? NULL : (const float *)L->mins + n * ng;
    const v16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16 a0[MB], a1[MB];
    memset(a0, 0, sizeof a0);
    memset(a1, 0, sizeof a1);
    for (int64_t g = 0; g < ng; g++) {
        const float s = half_to_f32(scale[g], L->f16);
        const v16 table = iota * s + (L->sym ? -8.f * s : L->f32mins ? minf[g] : half_to_f32(mins[g], L->f16));
        for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
            v16i b = widen_u8(w + k / 2);
            v16 lo = __builtin_shuffle(table, b & 15), hi = __builtin_shuffle(table, b >> 4);
            for (int m = 0; m < M; m++) {
                a0[m] += ld16(x + m * Kp + k) * lo;
                a1[m] += ld16(x + m * Kp + k + 16) * hi;
            }
        }
    }
    for (int m = 0; m < M; m++) out[m * ldo + n] = hsum(a0[m] + a1[m]) + (L->bias ? L->bias[n] : 0.f);
}

/* Whether int4's one-token rows take a bf16 x by AVX512-BF16's dot product here (csrc/gemv_int4_bf16dot.h). */
int gemv_int4_bf16dot(void) {
#ifdef GEMV_INT4_BF16DOT
    return 1;
#else
    return 0;
#endif
}

/* Whether int4's one-token rows take a float32 x as int16 by AVX512-VNNI's vpdpwssd here, in W4A8's order
 * (csrc/gemv_int4_int16dot.h). */
int gemv_int4_int16dot(void) {
#ifdef GEMV_INT4_INT16DOT
    return 1;
#else
    return 0;
#endif
}

/* The most rows of x a call may have for int4's rows to take a float32 x as int16 at several tokens (where
 * gemv_int4_int16dot says they do): model/kernel_plan.py's handful, checked against it by the tests. */
int gemv_int4_few_tokens(void) { return INT4_FEW_TOKENS; }

/* Whether int4's one-token rows take a float32 x as int16 in blocks of 32 here (csrc/gemv_avx2.h: AVX2 without VNNI;
 * csrc/gemv_int4_int16dot.h: AVX512-VNNI). */
int gemv_int4_x_int16(void) {
#ifdef INT4_M1_X_INT16
    return 1;
#else
    return 0;
#endif
}

/* Whether int4's one-token rows against x as int16 go in W4A8's order here (AVX512-VNNI's vpdpwssd rows,
 * csrc/gemv_int4_int16dot.h: a float32 x; AVX2's madd rows, csrc/gemv_avx2.h: every x). */
int gemv_int4_int16_ordered(void) {
#if defined(GEMV_INT4_INT16DOT) || defined(INT4_M1_ROWS_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* (declared in csrc/gemv_common.h; o, xm, mm: linear_gemv's chunk of at most MAX_M rows of x) */
void gemv_int4(float *o, int64_t ldo, const float *xm, int64_t ldx, int mm, int64_t N, const Layer *layer,
               float *scratch, int num_threads) {
    Layer L = *layer;
    const int64_t K = L.K, G = L.G;
    int64_t Kp = (K + G - 1) / G * G;
#if defined(INT4_M1_CHUNK) /* one token: the ISA's rows (csrc/gemv_avx512.h, csrc/gemv_avx2.h, and below) */
    if (mm == 1) {
        float *xg = scratch + (Kp + INT4_M1_CHUNK - 1) / INT4_M1_CHUNK * INT4_M1_CHUNK;
#if defined(GEMV_INT4_BF16DOT)
        const int dot = bf16_exact(xm, K); /* (x a bf16 model's: vdpbf16ps, gemv_int4_bf16dot.h) */
#else
        const int dot = 0;
#endif
#if defined(GEMV_INT4_INT16DOT)
        const int i16 = !dot; /* (a float32 x: int16 blocks by vpdpwssd, gemv_int4_int16dot.h) */
        if (i16) int4_stage_m1_int16(scratch, xg, xm, K, Kp, G);
#else
        const int i16 = 0;
#endif
        if (dot) int4_stage_m1_bf16((uint16_t *)scratch, xg, xm, K, Kp, G);
        else if (!i16) INT4_M1_STAGE(scratch, xg, xm, K, Kp, G);
        L.Kv = Kp;
#if defined(INT4_M1_ROWS_AVX2)
        const int ordered = 1; /* (AVX2's rows, csrc/gemv_avx2.h: every x as int16, in W4A8's order) */
#else
        const int ordered = dot || i16;
#endif
        int l2 = 0; /* (the ordered rows: a pass's rows and the prefetch's level as W4A8's, read once) */
        const int rows = ordered ? gemv_w4a8_m1_order(Kp / 2, &l2) : 1;
#if !defined(INT4_M1_ROWS_AVX2)
        const uint16_t *xb = (const uint16_t *)scratch;
#endif
        row_queue_t q;
        rq_init(&q, N, num_threads, rows, Kp / 2);
#if defined(GEMV_INT4_INT16DOT)
#define INT4_ROWS_M1(R, ahead) \
    (i16 ? int4_rows_m1_int16(o, scratch, xg, &L, n, R, ahead, l2)  \
         : int4_rows_m1_bf16dot(o, xb, xg, &L, n, R, ahead, l2))
#elif defined(INT4_M1_ROWS_AVX2)
#define INT4_ROWS_M1(R, ahead) int4_rows_m1_avx2(o, scratch, xg, &L, n, R, ahead, l2)
#else
#define INT4_ROWS_M1(R, ahead) int4_rows_m1_bf16dot(o, xb, xg, &L, n, R, ahead, l2)
#endif
#pragma omp parallel num_threads(num_threads)
        {
            int64_t n, end;
            while (rq_take(&q, &n, &end)) {
                if (rows == 4)
                    for (; n + 4 <= end; n += 4) INT4_ROWS_M1(4, n + 12 <= N);
                else if (rows == 2)
                    for (; n + 2 <= end; n += 2) INT4_ROWS_M1(2, n + 6 <= N);
                for (; n < end; n++) {
#if defined(INT4_M1_ROW) /* (AVX-512's float rows, where neither dot product orders them) */
                    if (!ordered) INT4_M1_ROW(o, scratch, xg, &L, n); else
#endif
                    INT4_ROWS_M1(1, 0);
                }
            }
        }
#undef INT4_ROWS_M1
        return;
    }
#endif
#if defined(GEMV_INT4_INT16DOT)
    /* a handful of tokens of a float32 model: x as int16 in blocks of 32, as at one token (csrc/gemv_int4_int16dot.h);
     * a bfloat16 model's x (every row bf16, csrc/gemv_bf16dot.h) keeps the float rows, exact for it */
    int exact = 1;
    for (int m = 0; m < mm && exact && L.M <= INT4_FEW_TOKENS; m++) exact = x_is_bf16(xm + m * ldx, K);
    if (L.M <= INT4_FEW_TOKENS && !exact) {
        const int64_t xstride = (Kp + 127) / 128 * INT4_X16_CHUNK_FLOATS, ngp = (Kp / G + 15) / 16 * 16;
        float *xg = scratch + mm * xstride;
        for (int m = 0; m < mm; m++) int4_stage_m1_int16(scratch + m * xstride, xg + m * ngp, xm + m * ldx, K, Kp, G);
        L.Kv = Kp;
        row_queue_t q;
        rq_init(&q, N, num_threads, 1, Kp / 2);
#define RT(T) int4_row_mt_int16(o + j * ldo, ldo, scratch + j * xstride, xstride, xg + j * ngp, ngp, &L, n, T)
#pragma omp parallel num_threads(num_threads)
        {
            int64_t n0, end;
            while (rq_take(&q, &n0, &end))
                for (int64_t n = n0; n < end; n++)
                    for (int j = 0; j < mm; j += 4) switch (mm - j < 4 ? mm - j : 4) {
                        case 1: RT(1); break;
                        case 2: RT(2); break;
                        case 3: RT(3); break;
                        default: RT(4); break;
                        }
        }
#undef RT
        return;
    }
#endif
    /* Stage x zero-padded to Kp (whatever the codes past K, a zero x makes them add nothing). */
    float *xp = scratch;
    for (int m = 0; m < mm; m++) {
        memcpy(xp + m * Kp, xm + m * ldx, K * sizeof(float));
        memset(xp + m * Kp + K, 0, (Kp - K) * sizeof(float));
    }
    L.Kv = Kp;
#if defined(GEMV_INT4_AVX512)
#define R4(c) int4_row_avx512(o + j * ldo, ldo, xp + j * Kp, c, &L, n)
#elif defined(GEMV_AVX2)
    /* each row's per-group sums of x, after the staged rows (scratch holds MAX_M * Kp / G more floats) */
    const int64_t ng = Kp / G;
    float *xg = scratch + (int64_t)mm * Kp;
    for (int m = 0; m < mm; m++)
        for (int64_t g = 0; g < ng; g++) {
            float t = 0.f;
            for (int64_t k = g * G; k < (g + 1) * G; k++) t += xp[m * Kp + k];
            xg[m * ng + g] = t;
        }
#define R4(c) int4_row_avx2(o + j * ldo, ldo, xp + j * Kp, xg + j * ng, c, &L, n)
#else
#define R4(c) int4_row(o + j * ldo, ldo, xp + j * Kp, c, &L, n)
#endif
#pragma omp parallel num_threads(num_threads)
    FOR_ROWS(N, mm, R4);
}
