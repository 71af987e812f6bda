/*
 * W4A8 (and Q8_0 blocks against int8 x) at many tokens (prefill, large batches): csrc/gemv_w4a8.c's arithmetic
 * (int4 weights in groups, x quantized to int8 per row or per 32-weight block, vpdpbusd's exact int32 sums) as a
 * tiled GEMM.
 *
 * Why: gemv_w4a8's rows put one weight row's four blocks in a vector's lanes, so every 128 weights and row of x end
 * in an int-to-float conversion, a permute of the scales and an FMA beside the two vpdpbusd, on the same ports, and
 * the weights are streamed again for every 16 rows of x. Here a vector's 16 lanes are 16 weight rows: the rows of a
 * panel are repacked (once a call, in this thread's buffer) so that dword j of block b of the 16 rows is one vector;
 * each vpdpbusd meets 4 bytes of one row of x, broadcast, and a block (or a group, where x has one scale a row) ends
 * in one conversion and FMA for 16 outputs. Per 32 weights, 16 outputs and a row of x: 8 vpdpbusd and 2-3 float
 * operations, where the rows took 8 vpdpbusd and 12. The panel stays in cache while every row of x passes by.
 *
 * GGUF's Q8_0 blocks against int8 x (csrc/gemv_q8.c's q8a8) take the same tiles: 32 int8 weights a block, read
 * as w + 128 (vpdpbusd's unsigned operand: the sign bit flipped at repacking) with -128 scale as the block's min.
 * GGUF's Q6_K superblocks against x in blocks (csrc/gemv_q6k.c's q6ka8) too: each tile's rows unpacked to their
 * codes (0..63) as int8 blocks are laid out, a float scale d * sc per 16 weights (a block's low and high halves: two
 * int32 sums, each converted and scaled), the -32 of every code joining through x's sums per 16 (xo, as the rows).
 * GGUF's Q4_K superblocks (csrc/gemv_q4k.c's q4ka8) are int4 groups of 32 once unpacked: each tile's rows repacked
 * to the int4 blocks' nibble order, their float scales d * sc and mins -dmin * m, then the int4 tiles as they are.
 *
 * Panel layout (TILES tiles of NR rows): wt[t][b][j][r] (uint32: bytes 4j .. 4j + 3 of block b of row r; int4: low
 * nibbles q[4j .. 4j + 3], high nibbles q[16 + 4j ..], j < 4; int8: q[4j ..], j < 8), sc[t][g][r] and mn[t][g][r]
 * as float (mn = -8 sc for int4 without mins, -128 sc for int8); rows past N are zero. The staged x
 * (csrc/gemv_w4a8.c's layout) keeps each half block's 16 bytes together, so the dwords of a block's low and high
 * halves (int4: nibbles; int8: weights 4j and 16 + 4j) are 4j and 64 + 4j bytes into its run.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define GEMM_A8 1
#endif

#define NR 16   /* weight rows per tile: one lane each */
#define TILES 4 /* tiles per panel: a block of x rows is loaded once for the panel's 64 weight rows */
#define MR 8    /* rows of x per register block */
#include "gemv_rows.h"
#include "q6k_unpack.h"
#include "q4k_unpack.h"

/* csrc/gemv_w4a8.c: one row of x quantized and staged; returns its scale. */
float w4a8_stage_row(const float *xr, int64_t K, int64_t G, int8_t *dst, int64_t Kx, float *xg, int64_t ngp,
                     float *xb);

#ifdef GEMM_A8
typedef struct {
    const uint8_t *w;
    const uint16_t *scale;
    const void *mins;
    int f16, f32mins, sym, dpb; /* dpb: dwords a block (4: int4, 8: int8 and Q6_K) */
    int q6k;                    /* Q6_K superblocks: ng = K / 16 scales a row, no mins */
    int q4k;                    /* Q4_K superblocks: ng = K / 32 scales and mins a row, as float */
    float min_mult;             /* sym: the mins are min_mult * scale (-8 int4, -128 int8) */
    int64_t N, nb, ng;          /* weight rows, 32-weight blocks and groups a row */
} Weights;

/* v[i] (16 dwords, row i) -> v[c] holding column c of the 16 x 16 matrix: pairs of rows interleaved, then pairs of
 * pairs (each 128-bit lane now a 4 x 4 transpose), then the 128-bit lanes exchanged between groups of four rows. */
static inline __attribute__((always_inline)) void transpose16(__m512i v[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    __m512i u[4][4]; /* u[q][e]: lane L holds element 4L + e of rows 4q .. 4q + 3 */
    for (int q = 0; q < 4; q++) {
        u[q][0] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
        u[q][1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
        u[q][2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
        u[q][3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
    }
    for (int e = 0; e < 4; e++) {
        const __m512i p0 = _mm512_shuffle_i32x4(u[0][e], u[1][e], 0x88);
        const __m512i p1 = _mm512_shuffle_i32x4(u[0][e], u[1][e], 0xDD);
        const __m512i p2 = _mm512_shuffle_i32x4(u[2][e], u[3][e], 0x88);
        const __m512i p3 = _mm512_shuffle_i32x4(u[2][e], u[3][e], 0xDD);
        v[e] = _mm512_shuffle_i32x4(p0, p2, 0x88);     /* lane 0 of each: column e */
        v[4 + e] = _mm512_shuffle_i32x4(p1, p3, 0x88); /* lane 1: column 4 + e */
        v[8 + e] = _mm512_shuffle_i32x4(p0, p2, 0xDD);
        v[12 + e] = _mm512_shuffle_i32x4(p1, p3, 0xDD);
    }
}

/* 16 groups' scales (or mins) of one row from group g0 (cnt of them) as float. */
static inline __attribute__((always_inline)) __m512 groups16(const void *p, int f32, int f16, __mmask16 mk) {
    if (f32) return _mm512_maskz_loadu_ps(mk, p);
    const __m256i h = _mm256_maskz_loadu_epi16(mk, p);
    return f16 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Rows n0 .. n0 + NR - 1 into one tile of the layout above (rows past N zero: no weights, no scales): 64 bytes (4
 * blocks) of each row a vector, transposed 16 x 16 dwords at once (the byte-by-byte loop cost as much as the GEMM's
 * arithmetic at 64 rows of x); the group scales and mins likewise, 16 groups at a time. */
static void repack_tile(const Weights *W, int64_t n0, uint32_t *wt, float *sc, float *mn) {
    const int64_t ng = W->ng, rows = W->N - n0 < NR ? W->N - n0 : NR, nd = W->nb * W->dpb; /* dwords a row */
    const uint32_t flip = W->dpb == 8 ? 0x80808080u : 0; /* int8: w + 128, vpdpbusd's unsigned operand */
    __m512i v[16];
    for (int64_t i0 = 0; i0 + 16 <= nd; i0 += 16) {
        for (int r = 0; r < NR; r++)
            v[r] = r < rows ? _mm512_loadu_si512((const void *)(W->w + ((n0 + r) * nd + i0) * 4))
                            : _mm512_setzero_si512();
        transpose16(v);
        for (int c = 0; c < 16; c++)
            _mm512_store_si512((void *)(wt + (i0 + c) * NR), _mm512_xor_si512(v[c], _mm512_set1_epi32((int)flip)));
    }
    for (int64_t i = nd / 16 * 16; i < nd; i++) /* the last dwords (int4: 1-3 blocks; int8: one), one by one */
        for (int r = 0; r < NR; r++) {
            uint32_t d = 0;
            if (r < rows) memcpy(&d, W->w + ((n0 + r) * nd + i) * 4, 4);
            wt[i * NR + r] = d ^ flip; /* (rows past N: zero scales, whatever the codes) */
        }
    for (int64_t g0 = 0; g0 < ng; g0 += 16) {
        const int64_t cnt = ng - g0 < 16 ? ng - g0 : 16;
        const __mmask16 mk = (__mmask16)((1u << cnt) - 1);
        for (int pass = 0; pass < (W->sym ? 1 : 2); pass++) {
            for (int r = 0; r < NR; r++) {
                const int64_t at = (n0 + r) * ng + g0;
                v[r] = r >= rows ? _mm512_setzero_si512()
                     : pass == 0 ? _mm512_castps_si512(groups16(W->scale + at, 0, W->f16, mk))
                     : _mm512_castps_si512(W->f32mins ? groups16((const float *)W->mins + at, 1, 0, mk)
                                                      : groups16((const uint16_t *)W->mins + at, 0, W->f16, mk));
            }
            transpose16(v);
            for (int c = 0; c < cnt; c++) {
                const __m512 f = _mm512_castsi512_ps(v[c]);
                if (pass == 0) {
                    _mm512_store_ps(sc + (g0 + c) * NR, f);
                    if (W->sym) _mm512_store_ps(mn + (g0 + c) * NR, _mm512_mul_ps(f, _mm512_set1_ps(W->min_mult)));
                } else {
                    _mm512_store_ps(mn + (g0 + c) * NR, f);
                }
            }
        }
    }
}

/* Rows n0 .. n0 + NR - 1 of Q6_K superblocks into one tile: each row's codes unpacked into `rows_buf` (NR x K
 * bytes), then transposed as int8 blocks are; the scales d * sc to sc[g][r] (g < K / 16). */
static void repack_tile_q6k(const Weights *W, int64_t n0, uint8_t *rows_buf, uint32_t *wt, float *sc) {
    const int64_t rows = W->N - n0 < NR ? W->N - n0 : NR, K = W->nb * 32, nsb = K / 256, nd = K / 4;
    float s[16];
    for (int r = 0; r < NR; r++)
        for (int64_t sb = 0; sb < nsb; sb++) {
            if (r < rows) {
                q6k_unpack(W->w + ((n0 + r) * nsb + sb) * SB_BYTES, rows_buf + r * K + 256 * sb, s);
            } else {
                memset(rows_buf + r * K + 256 * sb, 0, 256);
                memset(s, 0, sizeof s);
            }
            for (int j = 0; j < 16; j++) sc[(16 * sb + j) * NR + r] = s[j];
        }
    __m512i v[16];
    for (int64_t i0 = 0; i0 < nd; i0 += 16) { /* (K a multiple of 256: whole runs of 16 dwords) */
        for (int r = 0; r < NR; r++) v[r] = _mm512_loadu_si512((const void *)(rows_buf + r * K + i0 * 4));
        transpose16(v);
        for (int c = 0; c < 16; c++) _mm512_store_si512((void *)(wt + (i0 + c) * NR), v[c]);
    }
}

/* Rows n0 .. n0 + NR - 1 of Q4_K superblocks into one tile of int4 blocks: each row's sub-blocks repacked into
 * `rows_buf` (NR x K / 2 bytes; byte t of a block: code t low, code 16 + t high, as the int4 layout), then
 * transposed as repack_tile's; d * sc to sc[g][r], -dmin * m to mn[g][r]. */
static void repack_tile_q4k(const Weights *W, int64_t n0, uint8_t *rows_buf, uint32_t *wt, float *sc, float *mn) {
    const int64_t rows = W->N - n0 < NR ? W->N - n0 : NR, K = W->nb * 32, nsb = K / 256, nd = K / 8;
    for (int r = 0; r < NR; r++)
        for (int64_t sb = 0; sb < nsb; sb++) {
            uint8_t *dst = rows_buf + r * (K / 2) + 128 * sb;
            float *s = sc + 8 * sb * NR + r, *m = mn + 8 * sb * NR + r;
            if (r >= rows) {
                memset(dst, 0, 128);
                for (int j = 0; j < 8; j++) s[j * NR] = m[j * NR] = 0.f;
                continue;
            }
            const uint8_t *b = W->w + ((n0 + r) * nsb + sb) * Q4K_BYTES, *qs = b + 16;
            for (int c = 0; c < 4; c++) /* chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high */
                for (int t = 0; t < 16; t++) {
                    const uint8_t lo = qs[32 * c + t], hi = qs[32 * c + 16 + t];
                    dst[32 * c + t] = (uint8_t)((lo & 15) | (hi << 4));
                    dst[32 * c + 16 + t] = (uint8_t)((lo >> 4) | (hi & 0xF0));
                }
            q4k_scale_floats(b, s, m, NR);
        }
    __m512i v[16];
    for (int64_t i0 = 0; i0 < nd; i0 += 16) { /* (K a multiple of 256: whole runs of 16 dwords) */
        for (int r = 0; r < NR; r++) v[r] = _mm512_loadu_si512((const void *)(rows_buf + r * (K / 2) + i0 * 4));
        transpose16(v);
        for (int c = 0; c < 16; c++) _mm512_store_si512((void *)(wt + (i0 + c) * NR), v[c]);
    }
}

#include "group_window.h" /* high_nibbles */

static inline __attribute__((always_inline)) __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* One tile (16 weight rows from n0) against mr rows of staged x: out[r, n0 + lane] for the lanes in `keep`.
 * bpg: 32-weight blocks a group; each group's int32 sums become float once (x's one scale a row, xs, at the end),
 * or each block's where x has block scales (xb, groups of 32). */
static inline __attribute__((always_inline)) void tile_rows(float *out, int64_t ldo, const int8_t *xq, int64_t Kx,
                                                            const float *xs, const float *xg, const float *xb,
                                                            int64_t ngp, const uint32_t *wt, const float *sc,
                                                            const float *mn, int64_t ng, int bpg, const int mr,
                                                            const int q8, const float *bias, __mmask16 keep) {
    __m512 acc[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512i d[MR];
        for (int r = 0; r < mr; r++) d[r] = _mm512_setzero_si512();
        for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) {
            const __m512i *wb = (const __m512i *)(wt + b * (q8 ? 8 : 4) * NR);
            __m512i lo[4], hi[4]; /* weights 4j .. 4j + 3 and 16 + 4j .. of the block (int8: dwords j and 4 + j) */
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_load_si512(wb + j);
                lo[j] = q8 ? v : _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
                hi[j] = q8 ? _mm512_load_si512(wb + 4 + j) : high_nibbles(v);
            }
            const int64_t xo = (b >> 2) * 128 + (b & 3) * 16;
            for (int r = 0; r < mr; r++) {
                const int8_t *x = xq + r * Kx + xo;
                for (int j = 0; j < 4; j++) d[r] = _mm512_dpbusd_epi32(d[r], lo[j], bcast4(x + 4 * j));
                for (int j = 0; j < 4; j++) d[r] = _mm512_dpbusd_epi32(d[r], hi[j], bcast4(x + 64 + 4 * j));
            }
        }
        const __m512 s = _mm512_load_ps(sc + g * NR), mv = _mm512_load_ps(mn + g * NR);
        for (int r = 0; r < mr; r++) {
            const __m512 f = _mm512_cvtepi32_ps(d[r]);
            const __m512 sr = xb ? _mm512_mul_ps(s, _mm512_set1_ps(xb[r * ngp + g])) : s;
            acc[r] = _mm512_fmadd_ps(f, sr, acc[r]);
            acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xg[r * ngp + g]), acc[r]); /* the mins' term */
        }
    }
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (int r = 0; r < mr; r++)
        _mm512_mask_storeu_ps(out + r * ldo, keep, _mm512_fmadd_ps(acc[r], _mm512_set1_ps(xs[r]), bv));
}

/* One tile of Q6_K codes against mr rows of x in blocks: block b's halves (sub-blocks 2b, 2b + 1) each an int32 sum,
 * scaled by x's block scale xb and, with xo (-32 xb times the half's sum of xq), by the rows' d * sc. */
static inline __attribute__((always_inline)) void tile_rows_q6k(float *out, int64_t ldo, const int8_t *xq,
                                                                int64_t Kx, const float *xb, int64_t ngp,
                                                                const float *xo, int64_t K16, const uint32_t *wt,
                                                                const float *sc, int64_t nb, const int mr,
                                                                const float *bias, __mmask16 keep) {
    __m512 acc[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m512i *wb = (const __m512i *)(wt + b * 8 * NR);
        const __m512 s0 = _mm512_load_ps(sc + 2 * b * NR), s1 = _mm512_load_ps(sc + (2 * b + 1) * NR);
        const int64_t at = (b >> 2) * 128 + (b & 3) * 16;
        for (int r = 0; r < mr; r++) {
            const int8_t *x = xq + r * Kx + at;
            __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) lo = _mm512_dpbusd_epi32(lo, _mm512_load_si512(wb + j), bcast4(x + 4 * j));
            for (int j = 0; j < 4; j++)
                hi = _mm512_dpbusd_epi32(hi, _mm512_load_si512(wb + 4 + j), bcast4(x + 64 + 4 * j));
            const __m512 xbv = _mm512_set1_ps(xb[r * ngp + b]);
            const float *o = xo + r * K16 + 2 * b;
            acc[r] = _mm512_fmadd_ps(s0, _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), xbv, _mm512_set1_ps(o[0])), acc[r]);
            acc[r] = _mm512_fmadd_ps(s1, _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), xbv, _mm512_set1_ps(o[1])), acc[r]);
        }
    }
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (int r = 0; r < mr; r++) _mm512_mask_storeu_ps(out + r * ldo, keep, _mm512_add_ps(acc[r], bv));
}
#endif

#ifdef GEMM_A8
/* y = x W^T + bias for M rows of float32 x, all staged at once in a buffer of its own; q8: 1 int8 blocks (G 32,
 * float16 scales, no mins), 2 Q6_K superblocks (G 32: x's blocks; K a multiple of 256), 3 Q4_K superblocks (the
 * same), else int4 groups. Returns 0 where it runs out of memory. */
static int gemm_tiles(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N,
                      const void *w, const void *scale, const void *mins, int64_t G, int halves, const float *bias,
                      int num_threads, const int q8) {
    const int64_t Kp = (K + G - 1) / G * G, ng = Kp / G, ngp = (ng + 15) / 16 * 16, Kx = (Kp + 127) / 128 * 128;
    const int ablk = (halves >> 3) & 1, q6 = q8 == 2, q4 = q8 == 3;
    const int64_t K16 = q6 ? Kp / 16 : 0; /* Q6_K: xo, a float per 16 of x */
    /* staged x: scales, group sums, (block scales), codes, (xo) */
    const size_t stage_bytes = (size_t)M * ((1 + (1 + ablk) * ngp + K16) * sizeof(float) + Kx);
    char *stage = aligned_alloc(64, (stage_bytes + 63) / 64 * 64);
    if (!stage) return 0;
    float *xs = (float *)stage, *xg = xs + M, *xb = ablk ? xg + (int64_t)M * ngp : NULL;
    int8_t *xq = (int8_t *)(xg + (int64_t)M * (1 + ablk) * ngp);
    float *xo = (float *)(xq + (int64_t)M * Kx);
    const Weights W = {.w = (const uint8_t *)w, .scale = (const uint16_t *)scale, .mins = mins, .f16 = halves & 1,
                       .f32mins = (halves >> 1) & 1, .sym = (halves >> 2) & 1, .dpb = q8 && !q4 ? 8 : 4,
                       .min_mult = q8 ? -128.f : -8.f, .N = N, .nb = Kp / 32, .ng = q6 ? Kp / 16 : ng,
                       .q6k = q6, .q4k = q4};
    const int64_t panel_rows = TILES * NR, panels = (N + panel_rows - 1) / panel_rows;
    const size_t wt_bytes = (size_t)TILES * W.nb * W.dpb * NR * 4, sc_bytes = (size_t)TILES * W.ng * NR * sizeof(float);
    /* a Q6_K (Q4_K) tile's codes, unpacked (repacked) before transposing */
    const size_t rows_bytes = q6 ? (size_t)NR * Kp : q4 ? (size_t)NR * Kp / 2 : 0;
    int failed = 0;
    int64_t next = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t m = M * t / nt; m < M * (t + 1) / nt; m++) {
            xs[m] = w4a8_stage_row(x + m * ldx, K, G, xq + m * Kx, Kx, xg + m * ngp, ngp, xb ? xb + m * ngp : NULL);
            for (int64_t j = 0; j < K16; j++) { /* half j % 2 of block j / 2: its 16 codes together (staged layout) */
                const int8_t *c = xq + m * Kx + (j >> 3) * 128 + ((j >> 1) & 3) * 16 + (j & 1) * 64;
                int32_t sum = 0;
                for (int i = 0; i < 16; i++) sum += c[i];
                xo[m * K16 + j] = -32.f * (float)sum * xb[m * ngp + j / 2];
            }
        }
        char *buf = aligned_alloc(64, wt_bytes + 2 * sc_bytes + rows_bytes);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        int stop;
#pragma omp atomic read
        stop = failed;
        if (!stop) {
            uint32_t *wt = (uint32_t *)buf;
            float *sc = (float *)(buf + wt_bytes), *mn = (float *)(buf + wt_bytes + sc_bytes);
            int64_t p, p_end;
            while (take_rows(&next, panels, 1, &p, &p_end)) {
                const int64_t n0 = p * panel_rows;
                for (int tt = 0; tt < TILES && n0 + tt * NR < N; tt++)
                    if (q6)
                        repack_tile_q6k(&W, n0 + tt * NR, (uint8_t *)(mn + TILES * W.ng * NR),
                                        wt + tt * W.nb * W.dpb * NR, sc + tt * W.ng * NR);
                    else if (q4)
                        repack_tile_q4k(&W, n0 + tt * NR, (uint8_t *)(mn + TILES * W.ng * NR),
                                        wt + tt * W.nb * W.dpb * NR, sc + tt * ng * NR, mn + tt * ng * NR);
                    else
                        repack_tile(&W, n0 + tt * NR, wt + tt * W.nb * W.dpb * NR, sc + tt * ng * NR,
                                    mn + tt * ng * NR);
                for (int m0 = 0; m0 < M; m0 += MR) {
                    const int mr = M - m0 < MR ? M - m0 : MR;
                    for (int tt = 0; tt < TILES && n0 + tt * NR < N; tt++) {
                        const int64_t nt0 = n0 + tt * NR, left = N - nt0;
                        const __mmask16 keep = left >= NR ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
                        const uint32_t *wtt = wt + tt * W.nb * W.dpb * NR;
                        const float *sct = sc + tt * W.ng * NR, *mnt = mn + tt * W.ng * NR;
                        const float *bt = bias ? bias + nt0 : NULL, *xbm = xb ? xb + m0 * ngp : NULL;
                        float *o = out + m0 * ldo + nt0;
#define TILE(c) if (q6) tile_rows_q6k(o, ldo, xq + m0 * Kx, Kx, xbm, ngp, xo + m0 * K16, K16, wtt, sct, W.nb, c, \
                                     bt, keep); \
                else tile_rows(o, ldo, xq + m0 * Kx, Kx, xs + m0, xg + m0 * ngp, xbm, ngp, wtt, sct, mnt, ng, \
                               (int)(G / 32), c, q8 == 1, bt, keep)
                        switch (mr) {
                        case 1: TILE(1); break;
                        case 2: TILE(2); break;
                        case 3: TILE(3); break;
                        case 4: TILE(4); break;
                        case 5: TILE(5); break;
                        case 6: TILE(6); break;
                        case 7: TILE(7); break;
                        default: TILE(8); break;
                        }
#undef TILE
                    }
                }
            }
        }
        free(buf);
    }
    free(stage);
    return !failed;
}
#endif

/*
 * y = x W^T + bias for M rows of float32 x, as gemv_w4a8 computes it (same arguments, `halves` its flags). Returns 0
 * where it has no path (no AVX512-VNNI, no memory): the caller then runs gemv_w4a8.
 */
int gemm_w4a8(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
              const void *scale, const void *mins, int64_t G, int halves, const float *bias, int num_threads) {
#ifdef GEMM_A8
    return gemm_tiles(out, ldo, x, ldx, M, K, N, w, scale, mins, G, halves, bias, num_threads, 0);
#else
    (void)out, (void)ldo, (void)x, (void)ldx, (void)M, (void)K, (void)N, (void)w, (void)scale, (void)mins, (void)G;
    (void)halves, (void)bias, (void)num_threads;
    return 0;
#endif
}

/* The same for GGUF's Q8_0 blocks against int8 x (gemv_q8's q8a8; ablk: x in blocks of 32). */
int gemm_q8a8(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
              const void *scale, const float *bias, int ablk, int num_threads) {
#ifdef GEMM_A8
    const int halves = 1 | 4 | (ablk ? 8 : 0); /* float16 scales, no mins (-128 scale), x in blocks */
    return gemm_tiles(out, ldo, x, ldx, M, K, N, w, scale, NULL, 32, halves, bias, num_threads, 1);
#else
    (void)out, (void)ldo, (void)x, (void)ldx, (void)M, (void)K, (void)N, (void)w, (void)scale, (void)bias, (void)ablk;
    (void)num_threads;
    return 0;
#endif
}

/* The same for GGUF's Q4_K superblocks against x in blocks of 32 (gemv_q4k's q4ka8; K a multiple of 256). */
int gemm_q4k(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
             const float *bias, int num_threads) {
#ifdef GEMM_A8
    return gemm_tiles(out, ldo, x, ldx, M, K, N, w, NULL, NULL, 32, 8, bias, num_threads, 3);
#else
    (void)out, (void)ldo, (void)x, (void)ldx, (void)M, (void)K, (void)N, (void)w, (void)bias, (void)num_threads;
    return 0;
#endif
}

/* The same for GGUF's Q6_K superblocks against x in blocks of 32 (gemv_q6k's q6ka8; K a multiple of 256). */
int gemm_q6k(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
             const float *bias, int num_threads) {
#ifdef GEMM_A8
    return gemm_tiles(out, ldo, x, ldx, M, K, N, w, NULL, NULL, 32, 8, bias, num_threads, 2);
#else
    (void)out, (void)ldo, (void)x, (void)ldx, (void)M, (void)K, (void)N, (void)w, (void)bias, (void)num_threads;
    return 0;
#endif
}
