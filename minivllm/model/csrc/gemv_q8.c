/*
 * int8 weights in blocks of 32 with a float16 scale each: GGUF's Q8_0, run from the file's own bytes.
 *   w [N, Kp] int8 (Kp = K rounded up to 32), scale [N, Kp / 32] float16:   W[n, k] = scale[n, k / 32] * w[n, k]
 *
 * q8    weight-only: x stays float32; each block's 32 weights widen to float, times x, and the block's sum
 *       times its scale (the exact math of the dequantized weight, in float32).
 * q8a8  x quantized per row to int8 (symmetric, absmax / 127, round half to even, as w8a8 does):
 *         y[m, n] = xs[m] * sum_b scale[n, b] * sum_{k in b} w[n, k] xq[m, k]
 *       AVX512-VNNI's vpdpbusd multiplies unsigned by signed bytes, so each weight byte is read as w + 128 (a
 *       sign-bit flip) and the block's -128 * sum(xq) is added back through the scale: no stored min, the
 *       per-block sums of xq computed once per token. One vpdpbusd per 64 weights per row of x; the int32 sums
 *       of a chunk's two blocks are scaled in one FMA. Without VNNI a portable loop computes the same sums.
 *       With activation blocks (a8 == 2): x quantized per block of 32 instead, each its own scale xb[b] (llama.cpp's
 *       Q8_0 x Q8_0 dot product): block b's sum is scaled by scale[n, b] * xb[b], xg[b] holds xb[b] * sum xq, xs 1.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q8_VNNI 1
#endif

#define MB 4 /* rows of x per register block */
#include "gemv_rows.h"
#include "stage_rows.h"

typedef float v16 __attribute__((vector_size(64)));

static inline float f16_to_f32(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, sizeof v);
    return (float)v;
}

/* 16 int8 weights as float lanes (GCC 12 scalarises __builtin_convertvector from 8-bit lanes). */
static inline __attribute__((always_inline)) v16 widen16(const int8_t *p) {
#if defined(__AVX512F__)
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    v16 r;
    for (int i = 0; i < 16; i++) r[i] = (float)p[i];
    return r;
#endif
}

typedef struct {
    const int8_t *w;
    const uint16_t *scale;
    const float *bias;
    int64_t Kp, nb, nbp, Kx; /* nb blocks per row; nbp: floats between rows of xg (nb rounded up to 16);
                              * Kx: bytes (q8a8) or floats (q8) between staged rows of x */
} Q8Layer;

/* Weight-only: each block's weights widened once for all M rows; float32 sums scaled per block. */
static inline __attribute__((always_inline)) void q8_row(float *out, int64_t ldo, const float *x, int M,
                                                         const Q8Layer *L, int64_t n) {
    const int8_t *w = L->w + n * L->Kp;
    const uint16_t *sc = L->scale + n * L->nb;
    v16 acc[MB];
    memset(acc, 0, sizeof acc);
    for (int64_t b = 0; b < L->nb; b++) {
        const float d = f16_to_f32(sc[b]);
        const v16 w0 = widen16(w + 32 * b) * d, w1 = widen16(w + 32 * b + 16) * d;
        for (int m = 0; m < M; m++) {
            v16 x0, x1;
            memcpy(&x0, x + m * L->Kx + 32 * b, sizeof x0);
            memcpy(&x1, x + m * L->Kx + 32 * b + 16, sizeof x1);
            acc[m] += x0 * w0 + x1 * w1;
        }
    }
    for (int m = 0; m < M; m++) {
        float s = 0.f;
        for (int i = 0; i < 16; i++) s += acc[m][i];
        out[m * ldo + n] = s + (L->bias ? L->bias[n] : 0.f);
    }
}

#ifdef Q8_VNNI
/* One 64-weight chunk (two blocks) against M rows: one vpdpbusd per row, the blocks' scales in one FMA (`id` picks
 * them from the window win[0], or from win[m] for row m where x has block scales). */
static inline __attribute__((always_inline)) void chunk_q8(__m512 *acc, __m512i wv, const __m512 *win, __m512i id,
                                                           int per_row, const int8_t *xq, int64_t Kx, int M) {
    const __m512i wu = _mm512_xor_si512(wv, _mm512_set1_epi8((char)0x80));
    const __m512 s0 = _mm512_permutexvar_ps(id, win[0]);
    for (int m = 0; m < M; m++) {
        const __m512i xv = _mm512_loadu_si512((const void *)(xq + m * Kx));
        const __m512 s = per_row && m ? _mm512_permutexvar_ps(id, win[m]) : s0;
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, xv)), s, acc[m]);
    }
}

/* The superblock's 16 weight scales for each row of x: the same, or times row m's 16 block scales (xb, rows nbp
 * apart, zero-padded). */
static inline __attribute__((always_inline)) void q8_windows(__m512 *win, __m512 w, const float *xb, int64_t nbp,
                                                             int64_t b0, int M) {
    win[0] = w;
    if (xb)
        for (int m = 0; m < M; m++) win[m] = _mm512_mul_ps(w, _mm512_loadu_ps(xb + m * nbp + b0));
}

/* A row's last, partial superblock (cnt < 16 blocks from block 16 full), masked, against M rows of x. */
static inline __attribute__((always_inline)) void q8a8_tail(__m512 *acc, const int8_t *w, const uint16_t *sc,
                                                            const int8_t *xq, const float *xg, const float *xb, int M,
                                                            const Q8Layer *L, const __m512i *idx) {
    const int64_t full = L->nb / 16, cnt = L->nb - 16 * full;
    if (!cnt) return;
    __m512 wins[MB];
    const __m512 win = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << cnt) - 1), sc + 16 * full));
    q8_windows(wins, win, xb, L->nbp, 16 * full, M);
    for (int u = 0; 2 * u < cnt; u++) {
        const int8_t *wc = w + (16 * full + 2 * u) * 32;
        const __mmask64 mk = 2 * u + 1 < cnt ? ~(__mmask64)0 : (__mmask64)0xFFFFFFFFu;
        chunk_q8(acc, _mm512_maskz_loadu_epi8(mk, wc), wins, idx[u], xb != NULL, xq + (16 * full + 2 * u) * 32, L->Kx,
                 M);
    }
    const __m512 mv = _mm512_mul_ps(win, _mm512_set1_ps(-128.f));
    for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(xg + m * L->nbp + 16 * full), acc[m]);
}

/* The chunks' window indices: block 2u + lane / 8 of the superblock. */
static inline __attribute__((always_inline)) void q8_index(__m512i *idx) {
    const __m512i half = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int u = 0; u < 8; u++) idx[u] = _mm512_add_epi32(half, _mm512_set1_epi32(2 * u));
}

/* A superblock is 16 blocks (8 chunks): its scales are one window of 16, loaded once; chunk u's lanes take
 * theirs with a constant index (block 2u + lane / 8), and the min term (-128 scale, times the blocks' sums of
 * xq) joins the same accumulators once per superblock. A row's last, partial superblock loads masked. */
static inline __attribute__((always_inline)) void q8a8_row(float *out, int64_t ldo, const int8_t *xq,
                                                           const float *xs, const float *xg, const float *xb, int M,
                                                           const Q8Layer *L, int64_t n) {
    const int8_t *w = L->w + n * L->Kp;
    const uint16_t *sc = L->scale + n * L->nb;
    const __m512 neg128 = _mm512_set1_ps(-128.f);
    __m512i idx[8];
    q8_index(idx);
    __m512 acc[MB], wins[MB];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    const int64_t full = L->nb / 16;
    const int per_row = xb != NULL;
    for (int64_t sb = 0; sb < full; sb++) {
        const __m512 win = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 16 * sb)));
        q8_windows(wins, win, xb, L->nbp, 16 * sb, M);
        const int8_t *wc = w + sb * 512, *xc = xq + sb * 512;
        if (M > 1) /* two rows on (see gemv_q8) */
            for (int u = 0; u < 8; u++) __builtin_prefetch(wc + 64 * u + 2 * L->Kp);
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++)
            chunk_q8(acc, _mm512_loadu_si512((const void *)(wc + 64 * u)), wins, idx[u], per_row, xc + 64 * u, L->Kx,
                     M);
        const __m512 mv = _mm512_mul_ps(win, neg128);
        for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(xg + m * L->nbp + 16 * sb), acc[m]);
    }
    q8a8_tail(acc, w, sc, xq, xg, xb, M, L, idx);
    for (int m = 0; m < M; m++) out[m * ldo + n] = _mm512_reduce_add_ps(acc[m]) * xs[m] + (L->bias ? L->bias[n] : 0.f);
}

/* One token against weight rows n and n + 1 a pass, their chunks' loads alternating line by line (gemv_m1_order's
 * pairs, csrc/gemv_m1.h), each load of x serving both: each row's sums are q8a8_row's. */
static inline __attribute__((always_inline)) void q8a8_pair_m1(float *out, const int8_t *xq, float xs,
                                                               const float *xg, const float *xb, const Q8Layer *L,
                                                               int64_t n) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i idx[8];
    q8_index(idx);
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    const int64_t full = L->nb / 16;
    for (int64_t sb = 0; sb < full; sb++) {
        __m512 win[2], s[2];
        for (int r = 0; r < 2; r++) {
            win[r] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(L->scale + (n + r) * L->nb + 16 * sb)));
            s[r] = xb ? _mm512_mul_ps(win[r], _mm512_loadu_ps(xb + 16 * sb)) : win[r];
        }
#pragma GCC unroll 8
        for (int u = 0; u < 8; u++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(xq + sb * 512 + 64 * u));
            for (int r = 0; r < 2; r++) {
                const __m512i wu = _mm512_xor_si512(
                    _mm512_loadu_si512((const void *)(L->w + (n + r) * L->Kp + sb * 512 + 64 * u)), flip);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, xv)),
                                         _mm512_permutexvar_ps(idx[u], s[r]), acc[r]);
            }
        }
        for (int r = 0; r < 2; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(win[r], _mm512_set1_ps(-128.f)), _mm512_loadu_ps(xg + 16 * sb),
                                     acc[r]);
    }
    for (int r = 0; r < 2; r++) {
        q8a8_tail(acc + r, L->w + (n + r) * L->Kp, L->scale + (n + r) * L->nb, xq, xg, xb, 1, L, idx);
        out[n + r] = _mm512_reduce_add_ps(acc[r]) * xs + (L->bias ? L->bias[n + r] : 0.f);
    }
}
#define Q8_PAIRS 1
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 without VNNI: vpmaddubsw takes an unsigned operand, so each block multiplies |w| by x with w's sign moved
 * onto x (vpsignb; x is within +-127, so negating it cannot overflow), pairs summed in int16 (at most 2 * 128 *
 * 127, no saturation), widened by vpmaddwd against ones; one FMA scales the block. */
static inline __attribute__((always_inline)) void q8a8_row(float *out, int64_t ldo, const int8_t *xq, const float *xs,
                                                           const float *xg, const float *xb, int M, const Q8Layer *L,
                                                           int64_t n) {
    (void)xg;
    const int8_t *w = L->w + n * L->Kp;
    const uint16_t *sc = L->scale + n * L->nb;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MB];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < L->nb; b++) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 32 * b)), wa = _mm256_sign_epi8(wv, wv);
        const __m256 d = _mm256_set1_ps(f16_to_f32(sc[b]));
        for (int m = 0; m < M; m++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * L->Kx + 32 * b));
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv, wv)), ones);
            const __m256 s = xb ? _mm256_mul_ps(d, _mm256_set1_ps(xb[m * L->nbp + b])) : d; /* (x's block scale) */
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[m]);
        }
    }
    for (int m = 0; m < M; m++) {
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
        float v[4];
        _mm_storeu_ps(v, h);
        out[m * ldo + n] = ((v[0] + v[1]) + (v[2] + v[3])) * xs[m] + (L->bias ? L->bias[n] : 0.f);
    }
}
#else
static inline void q8a8_row(float *out, int64_t ldo, const int8_t *xq, const float *xs, const float *xg,
                            const float *xb, int M, const Q8Layer *L, int64_t n) {
    (void)xg;
    const int8_t *w = L->w + n * L->Kp;
    const uint16_t *sc = L->scale + n * L->nb;
    for (int m = 0; m < M; m++) {
        const int8_t *xr = xq + m * L->Kx;
        float y = 0.f;
        for (int64_t b = 0; b < L->nb; b++) {
            int32_t d = 0;
            for (int j = 0; j < 32; j++) d += (int32_t)w[32 * b + j] * xr[32 * b + j];
            y += (float)d * f16_to_f32(sc[b]) * (xb ? xb[m * L->nbp + b] : 1.f);
        }
        out[m * ldo + n] = y * xs[m] + (L->bias ? L->bias[n] : 0.f);
    }
}
#endif

/*
 * y = x W^T + bias for M rows of float32 x (rows ldx floats apart, K used); a8: q8a8 (2: with activation blocks),
 * else q8.
 *   scratch: >= M * (Kp + 2 Kp / 32 + 64) floats.
 */
void gemv_q8(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
             const void *scale, const float *bias, int a8, float *scratch, int num_threads) {
    const int64_t Kp = (K + 31) / 32 * 32, nb = Kp / 32, nbp = (nb + 15) / 16 * 16;
    Q8Layer L = {.w = (const int8_t *)w, .scale = (const uint16_t *)scale, .bias = bias, .Kp = Kp, .nb = nb,
                 .nbp = nbp, .Kx = Kp};
    if (!a8) { /* x zero-padded to Kp: the codes past K meet zeros */
        for (int m = 0; m < M; m++) {
            memcpy(scratch + m * Kp, x + m * ldx, (size_t)K * sizeof(float));
            memset(scratch + m * Kp + K, 0, (size_t)(Kp - K) * sizeof(float));
        }
#define RQ(c) q8_row(out + j * ldo, ldo, scratch + j * Kp, c, &L, n)
#pragma omp parallel num_threads(num_threads)
        FOR_ROWS(N, M, RQ);
        return;
    }
    L.Kx = (Kp + 63) / 64 * 64; /* a partial last chunk's x lanes read zeros */
    float *xs = scratch, *xg = scratch + M;
    int8_t *xq = (int8_t *)(xg + (int64_t)M * nbp);
    float *xb = a8 == 2 ? (float *)(xq + (int64_t)M * L.Kx) : NULL; /* activation blocks' scales */
    for (int m = 0; m < M; m++)
        xs[m] = stage_row(x + m * ldx, K, xq + m * L.Kx, L.Kx, xg + m * nbp, nbp, xb ? xb + m * nbp : NULL);
#define RA(c) q8a8_row(out + j * ldo, ldo, xq + j * L.Kx, xs + j, xg + j * nbp, xb ? xb + j * nbp : NULL, c, &L, n)
    /* Rows in chunks to whichever thread asks, each prefetched two rows on where x has several rows (q8a8_row).
     * Same-process A/B on a Zen 4 EPYC (2 threads, x in blocks): the 1B head (128256 x 2048) at 1 / 4 / 8 rows
     * 1.17x / 1.29x / 1.22x, 1B-shaped projections at 1 / 4 / 16 rows 1.30x / 1.45x / 1.40x against fixed halves
     * without prefetch; at one row the prefetch was mixed (head 1.05x more, projections 0.82x): not taken there. */
    row_queue_t q;
#ifdef Q8_PAIRS
    if (M == 1 && __atomic_load_n(&gemv_m1_order, __ATOMIC_RELAXED) == M1_PAIRS) {
#define P8(n) q8a8_pair_m1(out, xq, xs[0], xg, xb, &L, n)
#define O8(n) q8a8_row(out, ldo, xq, xs, xg, xb, 1, &L, n)
        rq_init(&q, N, num_threads, 2, Kp);
#pragma omp parallel num_threads(num_threads)
        FOR_ROW_PAIRS(P8, O8, &q);
        return;
    }
#endif
    rq_init(&q, N, num_threads, 1, Kp);
#pragma omp parallel num_threads(num_threads)
    FOR_ROW_CHUNKS(M, RA, &q);
}
