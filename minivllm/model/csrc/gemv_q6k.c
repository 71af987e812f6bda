/*
 * GGUF's Q6_K, run from the file's own superblocks: 210 bytes per 256 weights, rows of K / 256 superblocks.
 *   bytes 0..127 ql (low 4 bits), 128..191 qh (high 2 bits), 192..207 sc (int8, a scale per 16 weights),
 *   208..209 d (float16). Weight i of half h (i < 128): low nibble of ql[64 h + i % 64] for i < 64, high nibble
 *   for i >= 64; bits 2 (i / 32) and 2 (i / 32) + 1 of qh[32 h + i % 32] on top: q in 0..63, and
 *   W = d * sc[(128 h + i) / 16] * (q - 32)   (ggml's dequantize_row_q6_K).
 * llama.cpp's quantizer writes the head of its Q4_0 / Q4_K_M / Q5_K_M files in it (a third of a 1B model's bytes
 * a token): run as it is, it is 6.56 bits a weight where int8 blocks of 32 were 8.5, and exact.
 *
 * q6k    weight-only: x float32; each 16 codes widen to float, minus 32, times d * sc, against x.
 * q6ka8  x in blocks of 32 as int8 codes, each block its own scale xb (csrc/stage_rows.h, llama.cpp's Q8_0
 *        activations; its own Q6_K dot product takes Q8_K's one scale per 256):
 *          y = sum_sb sum_j d sc_j (xb[j / 2] sum_{k in j} q_k xq_k  -  32 xb[j / 2] sum_{k in j} xq_k)
 *        The codes q (unsigned, 0..63) meet xq (signed) in vpdpbusd, four products a lane, 16 lanes = 4
 *        sub-blocks of 16; each lane's float scale d sc_j xb[j / 2] is one permute of the superblock's 16; the
 *        second term (xo[j] = -32 xb[j / 2] sum xq, per row of x, computed once a call) is one FMA per
 *        superblock. AVX2 without VNNI: vpmaddubsw on the same unsigned codes (pairs at most 2 * 63 * 127, no
 *        saturation); elsewhere a portable loop.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q6_VNNI 1
#endif

#define MB 4 /* rows of x per register block */
#include "gemv_rows.h"
#include "stage_rows.h"
#include "q6k_unpack.h"
#include "superblock_rows.h"

typedef struct {
    const uint8_t *w;
    const float *bias;
    int64_t nsb, row_bytes;    /* superblocks per row, bytes per row */
    int64_t Kx, nbp, K16;      /* bytes between rows of staged codes, floats between rows of xb, of xo */
} Q6Layer;

/* Weight-only: weight row n against M rows of float32 x (rows Kx floats apart). */
static inline __attribute__((always_inline)) void q6k_row(float *out, int64_t ldo, const float *x, int M,
                                                          const Q6Layer *L, int64_t n) {
    const uint8_t *w = L->w + n * L->row_bytes;
    uint8_t q[256] __attribute__((aligned(64)));
    float s[16];
    v16 acc[MB];
    memset(acc, 0, sizeof acc);
    for (int64_t sb = 0; sb < L->nsb; sb++) {
        q6k_unpack(w + SB_BYTES * sb, q, s);
        for (int j = 0; j < 16; j++) {
            const v16 wv = (codes16(q + 16 * j) - 32.f) * s[j];
            for (int m = 0; m < M; m++) {
                v16 xv;
                memcpy(&xv, x + m * L->Kx + 256 * sb + 16 * j, sizeof xv);
                acc[m] += xv * wv;
            }
        }
    }
    store_rows16(out, ldo, acc, M, L->bias, n);
}

#ifdef Q6_VNNI
/* A superblock's codes in four registers of 64 (weights 0-63, 64-127, 128-191, 192-255), unpacked in registers: a
 * half's 64 ql bytes give its weights 0-63 (low nibbles) and 64-127 (high), its 32 qh bytes (in both 256-bit
 * halves) their bits 4-5 through 16-bit shifts by a count per half (4 / 2 for weights 0-31 / 32-63, 0 / -2 for
 * 64-95 / 96-127; bits crossing a byte land where the mask drops them). */
static inline __attribute__((always_inline)) void q6k_codes512(const uint8_t *b, __m512i *q) {
    const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(0x30);
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512((const void *)(b + 64 * h));
        const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
        q[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_sllv_epi16(hb, up), m2));
        q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                       _mm512_and_si512(_mm512_srlv_epi16(hb, down), m2));
    }
}

/* A superblock's codes (q6k_codes512) and its 16 scales d sc_j (ws), prefetching `ahead` bytes on. */
static inline __attribute__((always_inline)) void q6k_sb_codes(const uint8_t *blk, int64_t ahead, __m512i *q,
                                                              __m512 *ws) {
    for (int c = 0; c < SB_BYTES; c += 64) __builtin_prefetch(blk + c + ahead);
    q6k_codes512(blk, q);
    *ws = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)))),
                        _mm512_set1_ps(q6_half(blk + 208)));
}

/* One superblock's codes against one row of x: its staged codes xr, its 8 block scales xb8 and xo16 (-32 xb sum xq
 * per 16), into acc. */
static inline __attribute__((always_inline)) __m512 q6k_sb_dot(__m512 acc, const __m512i *q, __m512 ws,
                                                              const int8_t *xr, const float *xb8, const float *xo16) {
    const __m512i lane = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2);
    const __m512i pair = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 1);
    /* lane j: d sc_j xb[j / 2] (the superblock's 8 blocks of x, each two sub-blocks) */
    const __m512 win = _mm512_mul_ps(ws, _mm512_permutexvar_ps(pair, _mm512_maskz_loadu_ps(0xFF, xb8)));
    __m512 a = acc;
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[c], _mm512_loadu_si512((const void *)(xr + 64 * c)));
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(_mm512_add_epi32(lane, _mm512_set1_epi32(4 * c)),
                                                                        win), a);
    }
    return _mm512_fmadd_ps(ws, _mm512_loadu_ps(xo16), a);
}

/* x in blocks: one vpdpbusd per 64 codes and row of x, its lanes scaled in one FMA. Two rows on at several rows of x
 * (as csrc/gemv_q8.c's rows); at one, 512 bytes on: same-process A/B on the 1B head (Zen 4 EPYC, 2 threads, 12
 * interleaved rounds) 8.30 ms without, 7.71 / 7.75 / 7.88 with 512 / 1024 / 2048 bytes (a pass that only loads the
 * same bytes: 7.4): the unpacking left the prefetcher behind. */
static inline __attribute__((always_inline)) void q6ka8_row(float *out, int64_t ldo, const int8_t *xq,
                                                            const float *xb, const float *xo, int M, const Q6Layer *L,
                                                            int64_t n) {
    const uint8_t *w = L->w + n * L->row_bytes;
    __m512 acc[MB];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < L->nsb; sb++) {
        __m512i q[4];
        __m512 ws;
        q6k_sb_codes(w + SB_BYTES * sb, M > 1 ? 2 * L->row_bytes : 512, q, &ws);
        for (int m = 0; m < M; m++)
            acc[m] = q6k_sb_dot(acc[m], q, ws, xq + m * L->Kx + 256 * sb, xb + m * L->nbp + 8 * sb,
                                xo + m * L->K16 + 16 * sb);
    }
    for (int m = 0; m < M; m++) out[m * ldo + n] = _mm512_reduce_add_ps(acc[m]) + (L->bias ? L->bias[n] : 0.f);
}

/* One token against weight rows n and n + 1 a pass, their superblocks read in turn (gemv_m1_order's pairs, csrc/
 * gemv_m1.h), x's loads shared: each row's sums are q6ka8_row's. */
static inline __attribute__((always_inline)) void q6ka8_pair_m1(float *out, const int8_t *xq, const float *xb,
                                                                const float *xo, const Q6Layer *L, int64_t n) {
    const uint8_t *w = L->w + n * L->row_bytes;
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t sb = 0; sb < L->nsb; sb++)
        for (int r = 0; r < 2; r++) {
            __m512i q[4];
            __m512 ws;
            q6k_sb_codes(w + r * L->row_bytes + SB_BYTES * sb, 512, q, &ws);
            acc[r] = q6k_sb_dot(acc[r], q, ws, xq + 256 * sb, xb + 8 * sb, xo + 16 * sb);
        }
    for (int r = 0; r < 2; r++) out[n + r] = _mm512_reduce_add_ps(acc[r]) + (L->bias ? L->bias[n + r] : 0.f);
}
#define Q6K_PAIRS 1
#elif defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void q6ka8_row(float *out, int64_t ldo, const int8_t *xq,
                                                            const float *xb, const float *xo, int M, const Q6Layer *L,
                                                            int64_t n) {
    const uint8_t *w = L->w + n * L->row_bytes;
    uint8_t q[256] __attribute__((aligned(32)));
    float s[16] __attribute__((aligned(32)));
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MB];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < L->nsb; sb++) {
        q6k_unpack(w + SB_BYTES * sb, q, s);
        const __m256 s0 = _mm256_load_ps(s), s1 = _mm256_load_ps(s + 8);
        for (int t = 0; t < 8; t++) { /* block t of 32: sub-blocks 2t (lanes 0-3) and 2t + 1 (lanes 4-7) */
            const __m256i qv = _mm256_load_si256((const __m256i *)(q + 32 * t));
            const __m256 st = _mm256_set_m128(_mm_set1_ps(s[2 * t + 1]), _mm_set1_ps(s[2 * t]));
            for (int m = 0; m < M; m++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * L->Kx + 256 * sb + 32 * t));
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(qv, xv), ones);
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                                         _mm256_mul_ps(st, _mm256_set1_ps(xb[m * L->nbp + 8 * sb + t])), acc[m]);
            }
        }
        for (int m = 0; m < M; m++) {
            const float *o = xo + m * L->K16 + 16 * sb;
            acc[m] = _mm256_fmadd_ps(s1, _mm256_loadu_ps(o + 8), _mm256_fmadd_ps(s0, _mm256_loadu_ps(o), acc[m]));
        }
    }
    for (int m = 0; m < M; m++) {
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
        float v[4];
        _mm_storeu_ps(v, h);
        out[m * ldo + n] = ((v[0] + v[1]) + (v[2] + v[3])) + (L->bias ? L->bias[n] : 0.f);
    }
}
#else
static inline void q6ka8_row(float *out, int64_t ldo, const int8_t *xq, const float *xb, const float *xo, int M,
                             const Q6Layer *L, int64_t n) {
    const uint8_t *w = L->w + n * L->row_bytes;
    uint8_t q[256];
    float s[16];
    float acc[MB] = {0};
    for (int64_t sb = 0; sb < L->nsb; sb++) {
        q6k_unpack(w + SB_BYTES * sb, q, s);
        for (int m = 0; m < M; m++) {
            const int8_t *xr = xq + m * L->Kx + 256 * sb;
            for (int j = 0; j < 16; j++) {
                int32_t dot = 0;
                for (int k = 0; k < 16; k++) dot += (int32_t)q[16 * j + k] * xr[16 * j + k];
                acc[m] += s[j] * ((float)dot * xb[m * L->nbp + 8 * sb + j / 2] + xo[m * L->K16 + 16 * sb + j]);
            }
        }
    }
    for (int m = 0; m < M; m++) out[m * ldo + n] = acc[m] + (L->bias ? L->bias[n] : 0.f);
}
#endif

/*
 * y = x W^T + bias for M rows of float32 x (rows ldx floats apart), W [N, K] in Q6_K superblocks (K a multiple of
 * 256); a8: x in blocks of 32 as int8 codes (q6ka8), else float (q6k).
 *   scratch (a8): >= M * (3 K / 8 + 32) floats.
 */
void gemv_q6k(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
              const float *bias, int a8, float *scratch, int num_threads) {
    const int64_t nsb = K / 256, nb = K / 32, nbp = (nb + 15) / 16 * 16;
    Q6Layer L = {.w = (const uint8_t *)w, .bias = bias, .nsb = nsb, .row_bytes = nsb * SB_BYTES, .Kx = ldx,
                 .nbp = nbp, .K16 = K / 16};
    row_queue_t q;
    rq_init(&q, N, num_threads, 1, L.row_bytes);
    if (!a8) {
#define R6(c) q6k_row(out + j * ldo, ldo, x + j * ldx, c, &L, n)
#pragma omp parallel num_threads(num_threads)
        FOR_ROW_CHUNKS(M, R6, &q);
        return;
    }
    L.Kx = K;
    float *xb = scratch, *xg = xb + (int64_t)M * nbp, *xo = xg + (int64_t)M * nbp;
    int8_t *xq = (int8_t *)(xo + (int64_t)M * L.K16);
    for (int m = 0; m < M; m++) {
        int8_t *codes = xq + m * K;
        float *xbm = xb + m * nbp, *xom = xo + m * L.K16;
        stage_row(x + m * ldx, K, codes, K, xg + m * nbp, nbp, xbm);
        for (int64_t j = 0; j < L.K16; j++) {
            int32_t t = 0;
            for (int k = 0; k < 16; k++) t += codes[16 * j + k];
            xom[j] = -32.f * (float)t * xbm[j / 2];
        }
    }
#ifdef Q6K_PAIRS
    if (M == 1 && __atomic_load_n(&gemv_m1_order, __ATOMIC_RELAXED) == M1_PAIRS) {
#define P6(n) q6ka8_pair_m1(out, xq, xb, xo, &L, n)
#define O6(n) q6ka8_row(out, ldo, xq, xb, xo, 1, &L, n)
        rq_init(&q, N, num_threads, 2, L.row_bytes);
#pragma omp parallel num_threads(num_threads)
        FOR_ROW_PAIRS(P6, O6, &q);
        return;
    }
#endif
#define R6A(c) q6ka8_row(out + j * ldo, ldo, xq + j * K, xb + j * nbp, xo + j * L.K16, c, &L, n)
#pragma omp parallel num_threads(num_threads)
    FOR_ROW_CHUNKS(M, R6A, &q);
}
