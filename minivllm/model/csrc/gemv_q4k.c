/*
 * GGUF's Q4_K, run from the file's own superblocks: 144 bytes per 256 weights, rows of K / 256 superblocks.
 *   bytes 0..1 d, 2..3 dmin (float16), 4..15 the 8 sub-blocks' 6-bit scales sc and mins m (csrc/q4k_unpack.h),
 *   16..143 qs: 32-byte chunk c holds sub-block 2c's 32 codes in its low nibbles and 2c + 1's in its high ones;
 *   W = d sc_j q - dmin m_j for the codes q (0..15) of sub-block j   (ggml's dequantize_row_q4_K).
 * llama.cpp's Q4_K_M files hold most of their projections in it: converted to int4 groups of 32 with a float16
 * scale and a float32 min it was 5.5 bits a weight (a 1B model's step read 921 MB where llama.cpp's read 800); run
 * as it is, 4.5, and exact.
 *
 * q4k    weight-only: x float32; each 16 codes widen to float, times d sc_j, plus -dmin m_j, against x.
 * q4ka8  x in blocks of 32 as int8 codes, each block its own scale xb (csrc/stage_rows.h; llama.cpp's Q8_0 x, its
 *        own Q4_K dot product takes Q8_K's one scale per 256). A sub-block of 32 weights is a block of x:
 *          y = sum_sb sum_j (d sc_j xb_j sum_{k in j} q_k xq_k  -  dmin m_j xg_j),   xg_j = xb_j sum_{k in j} xq_k
 *        AVX-512 VNNI: the superblock's two 64-byte halves are shuffled by 128-bit lanes so that one register holds
 *        codes 0-15 of sub-blocks 0, 2, 4, 6 (low nibbles) and 1, 3, 5, 7 (high), another codes 16-31; x is staged
 *        in that order once a call, so two vpdpbusd fill a lane with 8 products of one sub-block and the 256
 *        weights end in two conversions and FMAs (Q4_0's rows take the same per 256; four, unshuffled). The lane
 *        scales d sc_j xb_j are two permutes of one vector [d sc_j xb_j, dmin m_j xg_j], whose upper half is
 *        subtracted as it is (the mins' term). AVX2 without VNNI: vpmaddubsw per sub-block; elsewhere a portable
 *        loop.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q4_VNNI 1
#endif

#define MB 4 /* rows of x per register block */
#include "gemv_rows.h"
#include "stage_rows.h"
#include "q4k_unpack.h"
#include "superblock_rows.h"

typedef struct {
    const uint8_t *w;
    const float *bias;
    int64_t nsb, row_bytes; /* superblocks per row, bytes per row */
    int64_t Kx, K16;        /* bytes (or floats) between rows of staged codes (of x), floats between rows of xv */
} Q4Layer;

/* Weight-only: weight row n against M rows of float32 x (rows Kx floats apart). */
static inline __attribute__((always_inline)) void q4k_row(float *out, int64_t ldo, const float *x, int M,
                                                          const Q4Layer *L, int64_t n) {
    const uint8_t *w = L->w + n * L->row_bytes;
    uint8_t q[256] __attribute__((aligned(64)));
    float s[8], mn[8];
    v16 acc[MB];
    memset(acc, 0, sizeof acc);
    for (int64_t sb = 0; sb < L->nsb; sb++) {
        q4k_unpack(w + Q4K_BYTES * sb, q, s, mn);
        for (int j = 0; j < 16; j++) {
            const v16 wv = codes16(q + 16 * j) * s[j / 2] + mn[j / 2];
            for (int m = 0; m < M; m++) {
                v16 xv;
                memcpy(&xv, x + m * L->Kx + 256 * sb + 16 * j, sizeof xv);
                acc[m] += xv * wv;
            }
        }
    }
    store_rows16(out, ldo, acc, M, L->bias, n);
}

#ifdef Q4_VNNI
/* A superblock's codes (shuffled as the header says: q[0..3]) and its lane scales ws ([d sc_j, dmin m_j]). */
static inline __attribute__((always_inline)) void q4k_sb_codes(const uint8_t *blk, __m512i *q, __m512 *ws) {
    const __m512i dsel = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           3); /* lanes 0-7: d, 8-15: dmin */
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m128i head = _mm_loadu_si128((const __m128i *)blk); /* dwords: d and dmin, u0, u1, u2 */
    *ws = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q4k_scales128(head))),
                        _mm512_permutexvar_ps(dsel, _mm512_castps128_ps512(_mm_cvtph_ps(head))));
    const __m512i h0 = _mm512_loadu_si512((const void *)(blk + 16));
    const __m512i h1 = _mm512_loadu_si512((const void *)(blk + 80));
    const __m512i a = _mm512_shuffle_i32x4(h0, h1, 0x88), b = _mm512_shuffle_i32x4(h0, h1, 0xDD);
    q[0] = _mm512_and_si512(a, m4), q[1] = _mm512_and_si512(b, m4);
    q[2] = _mm512_and_si512(_mm512_srli_epi16(a, 4), m4);
    q[3] = _mm512_and_si512(_mm512_srli_epi16(b, 4), m4);
}

/* One superblock's codes q against one row of x's staged codes (xr) and its [xb_j, xg_j] (xw), into acc. */
static inline __attribute__((always_inline)) __m512 q4k_sb_dot(__m512 acc, const __m512i *q, __m512 ws,
                                                              const int8_t *xr, __m512 xw) {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i even = _mm512_slli_epi32(_mm512_srli_epi32(lanes, 2), 1); /* lane l: sub-block 2 (l / 4) */
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512 win = _mm512_mul_ps(ws, xw);
    const __m512i pe = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0],
                                                               _mm512_loadu_si512((const void *)xr)),
                                           q[1], _mm512_loadu_si512((const void *)(xr + 64)));
    const __m512i po = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q[2],
                                                               _mm512_loadu_si512((const void *)(xr + 128))),
                                           q[3], _mm512_loadu_si512((const void *)(xr + 192)));
    __m512 t = _mm512_mask_sub_ps(acc, 0xFF00, acc, win);
    t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pe), _mm512_permutexvar_ps(even, win), t);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(po), _mm512_permutexvar_ps(odd, win), t);
}

/* x in blocks: the codes shuffled as the header says, four vpdpbusd, two conversions and FMAs a superblock and row
 * of x; xv: per superblock [xb_j, xg_j] (16 floats). */
static inline __attribute__((always_inline)) void q4ka8_row(float *out, int64_t ldo, const int8_t *xq,
                                                            const float *xv, int M, const Q4Layer *L, int64_t n) {
    const uint8_t *w = L->w + n * L->row_bytes;
    __m512 acc[MB];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < L->nsb; sb++) {
        const uint8_t *blk = w + Q4K_BYTES * sb;
        const int64_t ahead = M > 1 ? 2 * L->row_bytes : 512;
        for (int c = 0; c < Q4K_BYTES; c += 64) __builtin_prefetch(blk + c + ahead);
        __m512i q[4];
        __m512 ws;
        q4k_sb_codes(blk, q, &ws);
        for (int m = 0; m < M; m++)
            acc[m] = q4k_sb_dot(acc[m], q, ws, xq + m * L->Kx + 256 * sb, _mm512_loadu_ps(xv + m * L->K16 + 16 * sb));
    }
    for (int m = 0; m < M; m++) out[m * ldo + n] = _mm512_reduce_add_ps(acc[m]) + (L->bias ? L->bias[n] : 0.f);
}

/* One token against weight rows n and n + 1 a pass, their superblocks read in turn (gemv_m1_order's pairs, csrc/
 * gemv_m1.h: two streams a thread), x's loads shared: each row's sums are q4ka8_row's. */
static inline __attribute__((always_inline)) void q4ka8_pair_m1(float *out, const int8_t *xq, const float *xv,
                                                                const Q4Layer *L, int64_t n) {
    const uint8_t *w = L->w + n * L->row_bytes;
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t sb = 0; sb < L->nsb; sb++) {
        const __m512 xw = _mm512_loadu_ps(xv + 16 * sb);
        for (int r = 0; r < 2; r++) {
            const uint8_t *blk = w + r * L->row_bytes + Q4K_BYTES * sb;
            for (int c = 0; c < Q4K_BYTES; c += 64) __builtin_prefetch(blk + c + 512);
            __m512i q[4];
            __m512 ws;
            q4k_sb_codes(blk, q, &ws);
            acc[r] = q4k_sb_dot(acc[r], q, ws, xq + 256 * sb, xw);
        }
    }
    for (int r = 0; r < 2; r++) out[n + r] = _mm512_reduce_add_ps(acc[r]) + (L->bias ? L->bias[n + r] : 0.f);
}
#define Q4K_PAIRS 1
#elif defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void q4ka8_row(float *out, int64_t ldo, const int8_t *xq,
                                                            const float *xv, int M, const Q4Layer *L, int64_t n) {
    const uint8_t *w = L->w + n * L->row_bytes;
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(15);
    float s[8], mn[8];
    __m256 acc[MB];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < L->nsb; sb++) {
        const uint8_t *blk = w + Q4K_BYTES * sb;
        q4k_scale_floats(blk, s, mn, 1);
        const __m256 mv = _mm256_loadu_ps(mn);
        for (int c = 0; c < 4; c++) { /* chunk c: sub-blocks 2c (low nibbles) and 2c + 1 (high) */
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
            const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            for (int m = 0; m < M; m++) {
                const int8_t *xr = xq + m * L->Kx + 256 * sb + 64 * c;
                const float *xb = xv + m * L->K16 + 16 * sb;
                const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xr)),
                                                     ones);
                const __m256i p1 = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xr + 32))), ones);
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(s[2 * c] * xb[2 * c]), acc[m]);
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(s[2 * c + 1] * xb[2 * c + 1]),
                                         acc[m]);
            }
        }
        for (int m = 0; m < M; m++) /* the mins: -dmin m_j against x's block sums xg_j */
            acc[m] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xv + m * L->K16 + 16 * sb + 8), acc[m]);
    }
    for (int m = 0; m < M; m++) {
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
        float r[4];
        _mm_storeu_ps(r, h);
        out[m * ldo + n] = ((r[0] + r[1]) + (r[2] + r[3])) + (L->bias ? L->bias[n] : 0.f);
    }
}
#else
static inline void q4ka8_row(float *out, int64_t ldo, const int8_t *xq, const float *xv, int M, const Q4Layer *L,
                             int64_t n) {
    const uint8_t *w = L->w + n * L->row_bytes;
    uint8_t q[256];
    float s[8], mn[8];
    float acc[MB] = {0};
    for (int64_t sb = 0; sb < L->nsb; sb++) {
        q4k_unpack(w + Q4K_BYTES * sb, q, s, mn);
        for (int m = 0; m < M; m++) {
            const int8_t *xr = xq + m * L->Kx + 256 * sb;
            const float *xb = xv + m * L->K16 + 16 * sb;
            for (int j = 0; j < 8; j++) {
                int32_t dot = 0;
                for (int k = 0; k < 32; k++) dot += (int32_t)q[32 * j + k] * xr[32 * j + k];
                acc[m] += s[j] * xb[j] * (float)dot + mn[j] * xb[8 + j];
            }
        }
    }
    for (int m = 0; m < M; m++) out[m * ldo + n] = acc[m] + (L->bias ? L->bias[n] : 0.f);
}
#endif

/*
 * y = x W^T + bias for M rows of float32 x (rows ldx floats apart), W [N, K] in Q4_K superblocks (K a multiple of
 * 256); a8: x in blocks of 32 as int8 codes (q4ka8), else float (q4k).
 *   scratch (a8): >= M * (K / 2 + 64) + K / 4 floats.
 */
void gemv_q4k(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
              const float *bias, int a8, float *scratch, int num_threads) {
    const int64_t nsb = K / 256, nb = K / 32, nbp = (nb + 15) / 16 * 16;
    Q4Layer L = {.w = (const uint8_t *)w, .bias = bias, .nsb = nsb, .row_bytes = nsb * Q4K_BYTES, .Kx = ldx,
                 .K16 = K / 16};
    row_queue_t q;
    rq_init(&q, N, num_threads, 1, L.row_bytes);
    if (!a8) {
#define R4(c) q4k_row(out + j * ldo, ldo, x + j * ldx, c, &L, n)
#pragma omp parallel num_threads(num_threads)
        FOR_ROW_CHUNKS(M, R4, &q);
        return;
    }
    L.Kx = K;
    /* per row of x: xv [K / 16] ([xb_j, xg_j] a superblock), codes [K]; then one row's xb, xg and natural codes */
    float *xv = scratch, *xb = xv + (int64_t)M * L.K16, *xg = xb + nbp;
    int8_t *xq = (int8_t *)(xg + nbp), *tmp = xq + (int64_t)M * K;
    for (int m = 0; m < M; m++) {
        int8_t *codes = xq + m * K;
#ifdef Q4_VNNI
        stage_row(x + m * ldx, K, tmp, K, xg, nbp, xb);
        for (int64_t sb = 0; sb < nsb; sb++) /* codes 0-15 of sub-blocks 0, 2, 4, 6, 16-31 of them, then of 1, 3, ... */
            for (int s = 0; s < 4; s++)
                for (int part = 0; part < 4; part++) /* (part: half of the even sub-block, then of the odd one) */
                    memcpy(codes + 256 * sb + 64 * part + 16 * s, tmp + 256 * sb + 64 * s + 16 * part, 16);
#else
        (void)tmp;
        stage_row(x + m * ldx, K, codes, K, xg, nbp, xb);
#endif
        for (int64_t sb = 0; sb < nsb; sb++) {
            memcpy(xv + m * L.K16 + 16 * sb, xb + 8 * sb, 8 * sizeof(float));
            memcpy(xv + m * L.K16 + 16 * sb + 8, xg + 8 * sb, 8 * sizeof(float));
        }
    }
#ifdef Q4K_PAIRS
    if (M == 1 && __atomic_load_n(&gemv_m1_order, __ATOMIC_RELAXED) == M1_PAIRS) {
#define P4(n) q4ka8_pair_m1(out, xq, xv, &L, n)
#define O4(n) q4ka8_row(out, ldo, xq, xv, 1, &L, n)
        rq_init(&q, N, num_threads, 2, L.row_bytes);
#pragma omp parallel num_threads(num_threads)
        FOR_ROW_PAIRS(P4, O4, &q);
        return;
    }
#endif
#define R4A(c) q4ka8_row(out + j * ldo, ldo, xq + j * K, xv + j * L.K16, c, &L, n)
#pragma omp parallel num_threads(num_threads)
    FOR_ROW_CHUNKS(M, R4A, &q);
}
