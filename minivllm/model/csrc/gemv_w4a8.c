/*
 * W4A8: int4 weights (csrc/gemv.c's int4 layout: group-wise scale and min, bf16 or float16) against int8 activations
 * (each row of x quantized here, symmetric absmax / 127, round half to even, as w8a8 does):
 *
 *   y[m, n] = xs[m] * (sum_g scale[n, g] * sum_{k in g} q[n, k] xq[m, k]  +  sum_g min[n, g] * sum_{k in g} xq[m, k])
 *
 * Why: weight-only int4 widens every weight to float before its FMA (6-7 instructions per 32 weights),
 * which bounds it below its bytes on this class of CPU; llama.cpp's Q4_0 decode multiplies 4-bit weights
 * with 8-bit activations instead. Here AVX512-VNNI's vpdpbusd multiplies 64 nibbles (as unsigned bytes)
 * by 64 activation bytes per instruction, exact in int32; each 32-weight block's int32 sum is scaled
 * by its group's scale once. The min term needs only the per-group sums of xq, computed once per token.
 *
 * Staged x per row: xq padded with zeros to a multiple of 128 and permuted per 128-weight chunk into
 * [low halves of its 4 blocks | high halves], matching the nibbles of 64 weight bytes: byte j of block b
 * holds q[32b + j] (low) and q[32b + 16 + j] (high). Without VNNI a portable loop computes the same sums.
 *
 * Activation blocks (halves bit 3, groups of 32 only): each 32-weight block of x gets its own scale xb[b]
 * (absmax / 127 of the block: llama.cpp's Q8_0 activations, what its Q4_0 / Q4_1 dot products multiply), so
 * block b's int32 sum is scaled by scale[n, b] * xb[b] and the min term meets xg[b] = xb[b] * sum_{k in b} xq;
 * xs is then 1. One row-wide scale lets one outlier coarsen every other activation's codes; a block's scale
 * confines it. Where the weight scales are a 16-block window, the x scales are one 16-float vector beside it.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define W4A8_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define W4A8_AVX2 1
#endif

#define MB 4 /* rows of x per register block */
#include "gemv_rows.h"

typedef struct {
    const uint8_t *w;
    const uint16_t *scale;
    const void *mins;
    const float *bias;
    int f16, f32mins, sym;      /* scales (and mins) are float16, else bfloat16; mins are float32; no mins (sym):
                                 * each is -8 scale */
    int ablk;                   /* x quantized per 32-weight block (G 32): block scales xb beside xg */
    int l2;                     /* one-token rows' prefetch two passes ahead into L2, else into L1 */
    int64_t Kp, G, ng, ngp, Kx; /* ngp: floats between rows of xg (ng rounded up to 16, zero-padded); Kx: bytes
                                 * between staged rows of xq (Kp rounded up to 128) */
} W4A8Layer;

static inline float halff(uint16_t h, int f16) {
    if (f16) {
        _Float16 v;
        memcpy(&v, &h, sizeof v);
        return (float)v;
    }
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* sum_g min[g] * xg[g]: the min term of one weight row against one staged row (mn: the scales where sym). */
static inline float min_term(const void *mn, const float *xg, int64_t ng, int f16, int f32mins, int sym) {
    float s = 0.f;
    if (sym) {
#pragma omp simd reduction(+ : s)
        for (int64_t g = 0; g < ng; g++) s += -8.f * halff(((const uint16_t *)mn)[g], f16) * xg[g];
        return s;
    }
    if (f32mins) {
#pragma omp simd reduction(+ : s)
        for (int64_t g = 0; g < ng; g++) s += ((const float *)mn)[g] * xg[g];
        return s;
    }
#pragma omp simd reduction(+ : s)
    for (int64_t g = 0; g < ng; g++) s += halff(((const uint16_t *)mn)[g], f16) * xg[g];
    return s;
}

#ifdef W4A8_VNNI
/* Loads of weight-side data run past the row's end into the following rows (those lanes meet zero x,
 * or belong to a block no lane selects; they hold finite scales and mins): unmasked loads ran the
 * 576-wide rows ~1.4x faster than masked ones on Zen 4. Only the last rows (`last`), whose overrun
 * could leave the allocation, take masked loads. */
#define LOAD_W(mask, p) (last ? _mm512_maskz_loadu_epi8(mask, p) : _mm512_loadu_si512((const void *)(p)))
#define LOAD_H(mask, p) (last ? _mm256_maskz_loadu_epi16(mask, p) : _mm256_loadu_si256((const __m256i *)(p)))

#include "group_window.h"

/* One 128-weight chunk (4 blocks) against M rows: two vpdpbusd per row, then its blocks' scales (block 4u + lane / 4
 * of the superblock's window: `id` picks them from win[0], or from win[m] for row m where x has block scales). */
static inline __attribute__((always_inline)) void chunk_vnni(__m512 *acc, __m512i wv, const __m512 *win, __m512i id,
                                                             int per_row, const int8_t *xq, int64_t Kx, int M) {
    const __m512i lo = _mm512_and_si512(wv, _mm512_set1_epi8(0x0F)), hi = high_nibbles(wv);
    const __m512 s0 = _mm512_permutexvar_ps(id, win[0]);
    for (int m = 0; m < M; m++) {
        const int8_t *xr = xq + m * Kx;
        __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)xr));
        d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512((const void *)(xr + 64)));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), per_row && m ? _mm512_permutexvar_ps(id, win[m]) : s0, acc[m]);
    }
}

/* The superblock's window of weight scales (from group g0) for each of the M rows of x: the same window, or where x
 * has block scales (groups of 32: the window's 16 groups are the superblock's 16 blocks) times row m's 16. */
static inline __attribute__((always_inline)) void row_windows(__m512 *win, __m512 w, const float *xb, int64_t ngp,
                                                              int64_t g0, int M) {
    win[0] = w;
    if (xb)
        for (int m = 0; m < M; m++) win[m] = _mm512_mul_ps(w, _mm512_loadu_ps(xb + m * ngp + g0));
}

static inline __attribute__((always_inline)) void row_vnni(float *out, int64_t ldo, const int8_t *xq, const float *xs,
                                                           const float *xg, const float *xb, int M,
                                                           const W4A8Layer *L, int64_t n, int last) {
    const int64_t ng = L->ng, nbytes = L->Kp / 2, nchunks = (L->Kp + 127) / 128;
    const uint8_t *w = L->w + n * nbytes;
    const uint16_t *sc = L->scale + n * ng;
    const char *mn = L->sym ? (const char *)sc : (const char *)L->mins + n * ng * (L->f32mins ? 4 : 2);
    const int shift = __builtin_ctzll((uint64_t)(L->G / 32)); /* 32-weight blocks per group, log2 */
    /* A superblock is 16 blocks (4 chunks): its groups' scales are one window of at most 16, loaded once, and
     * chunk u's lanes pick theirs with a constant index (block 4u + lane / 4, as a group of the window): one
     * permute per chunk where computing the index took four. */
    __m512i idx[4];
    window_index(idx, shift);
    __m512 acc[MB], win[MB];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    const int64_t full = nbytes / 64 / 4; /* superblocks whose 4 chunks are whole */
    const int per_row = xb != NULL;
    prefetch_groups(L->scale, L->sym ? NULL : L->mins, n + 2, 1, ng, L->f32mins ? 4 : 2); /* two rows on */
    int64_t c = 0;
    for (int64_t sb = 0; sb < full; sb++, c += 4) {
        const int64_t g0 = (16 * sb) >> shift, cnt = ng - g0 < 16 ? ng - g0 : 16;
        row_windows(win, half16(LOAD_H((__mmask16)((1u << cnt) - 1), sc + g0), L->f16), xb, L->ngp, g0, M);
        const uint8_t *wc = w + c * 64;
        const int8_t *xc = xq + c * 128;
        if (M > 1) /* two rows on (see gemv_w4a8) */
            for (int u = 0; u < 4; u++) __builtin_prefetch(wc + 64 * u + 2 * nbytes);
        for (int u = 0; u < 4; u++)
            chunk_vnni(acc, _mm512_loadu_si512((const void *)(wc + 64 * u)), win, idx[u], per_row, xc + 128 * u,
                       L->Kx, M);
    }
    if (c < nchunks) { /* the last, partial superblock: chunks one by one, the row's end masked */
        const int64_t g0 = (16 * full) >> shift, cnt = ng - g0 < 16 ? ng - g0 : 16;
        row_windows(win, half16(LOAD_H((__mmask16)((1u << cnt) - 1), sc + g0), L->f16), xb, L->ngp, g0, M);
        for (int u = 0; c < nchunks; c++, u++) {
            int64_t left = nbytes - c * 64;
            __mmask64 mask = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
            chunk_vnni(acc, LOAD_W(mask, w + c * 64), win, idx[u], per_row, xq + c * 128, L->Kx, M);
        }
    }
    /* The min term joins the same accumulators, 16 groups at a time (xg is zero past ng), so each row
     * reduces once. */
    for (int64_t g0 = 0; g0 < ng; g0 += 16) {
        int64_t cnt = ng - g0 < 16 ? ng - g0 : 16;
        const __mmask16 mk = (__mmask16)((1u << cnt) - 1);
        __m512 mv = L->f32mins ? (last ? _mm512_maskz_loadu_ps(mk, (const float *)mn + g0)
                                       : _mm512_loadu_ps((const float *)mn + g0))
                               : half16(LOAD_H(mk, (const uint16_t *)mn + g0), L->f16);
        if (L->sym) mv = _mm512_mul_ps(mv, _mm512_set1_ps(-8.f)); /* mn is the scales */
        for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(xg + m * L->ngp + g0), acc[m]);
    }
    for (int m = 0; m < M; m++) out[m * ldo + n] = _mm512_reduce_add_ps(acc[m]) * xs[m] + (L->bias ? L->bias[n] : 0.f);
}

/* One 128-weight chunk of R weight rows (nbytes apart) against one token's staged x, loaded once for them. */
static inline __attribute__((always_inline)) void chunk_rows_vnni(__m512 *acc, const uint8_t *wc, int64_t nbytes,
                                                                  const int8_t *xc, const __m512 *s, const int R) {
    const __m512i xl = _mm512_loadu_si512((const void *)xc), xh = _mm512_loadu_si512((const void *)(xc + 64));
    for (int r = 0; r < R; r++) {
        const __m512i wv = _mm512_loadu_si512((const void *)(wc + r * nbytes));
        __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(wv, _mm512_set1_epi8(0x0F)), xl);
        d = _mm512_dpbusd_epi32(d, high_nibbles(wv), xh);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s[r], acc[r]);
    }
}

/* One token, R (4, or 2) weight rows (n .. n+R-1) a pass, none of them among the last rows (unmasked loads): each
 * chunk's x loaded once for the R rows, the window indices shared, the R sums reduced at the end. One row a pass
 * spent as much on its per-row work (the window, the partial chunk, the min term, the reduction) as on its 4.5
 * chunks for the 576-wide rows of a 135M model; at one token the x loads were as many as the weight loads. `ahead`:
 * rows of 0.3-4 KiB end before the hardware prefetcher ramps up, so the rows two passes on are prefetched (a
 * 2-thread chain of 1B-shaped weights, 304 MB: 13.7-15.5 -> 17.2-18.4 GB/s with four rows; the same for W8A8's
 * 2 KiB rows and the float rows measured no gain or a loss). */
static inline __attribute__((always_inline)) void rows_m1_vnni(float *out, const int8_t *xq, float xs,
                                                               const float *xg, const float *xb,
                                                               const W4A8Layer *L, int64_t n, int ahead,
                                                               const int R) {
    const int last = 0;
    const int64_t ng = L->ng, nbytes = L->Kp / 2, nchunks = (L->Kp + 127) / 128;
    const int shift = __builtin_ctzll((uint64_t)(L->G / 32));
    __m512i idx[4];
    window_index(idx, shift);
    const uint8_t *w = L->w + n * nbytes;
    const uint16_t *sc = L->scale + n * ng;
    __m512 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    /* the scales and mins of the pass after next (csrc/gemv_rows.h; past the last row a prefetch is a no-op) */
    prefetch_groups(L->scale, L->sym ? NULL : L->mins, n + 2 * R, R, ng, L->f32mins ? 4 : 2);
    const int64_t full = nbytes / 64 / 4;
    int64_t c = 0;
    for (int64_t sb = 0; sb <= full && c < nchunks; sb++) {
        const int64_t g0 = (16 * sb) >> shift, cnt = ng - g0 < 16 ? ng - g0 : 16;
        __m512 win[4];
        for (int r = 0; r < R; r++) win[r] = half16(LOAD_H((__mmask16)((1u << cnt) - 1), sc + r * ng + g0), L->f16);
        if (xb) { /* x's 16 block scales, once for the R rows (xb is zero-padded to ngp) */
            const __m512 xw = _mm512_loadu_ps(xb + g0);
            for (int r = 0; r < R; r++) win[r] = _mm512_mul_ps(win[r], xw);
        }
        for (int u = 0; u < 4 && c < nchunks; u++, c++) { /* (bytes past a row meet zero x) */
            if (ahead) /* the pass after next: as many bytes as this pass reads, two passes ahead */
                for (int r = 0; r < R; r++) {
                    const uint8_t *p = w + 2 * R * nbytes + c * 64 * R + r * 64;
                    if (L->l2) __builtin_prefetch(p, 0, 2);
                    else __builtin_prefetch(p);
                }
            __m512 s[4];
            for (int r = 0; r < R; r++) s[r] = _mm512_permutexvar_ps(idx[u], win[r]);
            chunk_rows_vnni(acc, w + c * 64, nbytes, xq + c * 128, s, R);
        }
    }
    for (int64_t g0 = 0; g0 < ng; g0 += 16) {
        const __m512 xgv = _mm512_loadu_ps(xg + g0);
        for (int r = 0; r < R; r++) {
            __m512 mv = L->f32mins ? _mm512_loadu_ps((const float *)L->mins + (n + r) * ng + g0)
                      : L->sym     ? half16(LOAD_H(0, sc + r * ng + g0), L->f16)
                                   : half16(LOAD_H(0, (const uint16_t *)L->mins + (n + r) * ng + g0), L->f16);
            if (L->sym) mv = _mm512_mul_ps(mv, _mm512_set1_ps(-8.f));
            acc[r] = _mm512_fmadd_ps(mv, xgv, acc[r]); /* (xg is zero past ng) */
        }
    }
    for (int r = 0; r < R; r++) out[n + r] = _mm512_reduce_add_ps(acc[r]) * xs + (L->bias ? L->bias[n + r] : 0.f);
}
#endif

#include "gemv_w4a8_avx2.h"

/* The same sums without VNNI, block by block from the staged layout. */
__attribute__((unused)) static inline void row_portable(float *out, int64_t ldo, const int8_t *xq, const float *xs,
                                                        const float *xg, const float *xb, int M, const W4A8Layer *L,
                                                        int64_t n) {
    const uint8_t *w = L->w + n * (L->Kp / 2);
    const uint16_t *sc = L->scale + n * L->ng;
    const char *mn = L->sym ? (const char *)sc : (const char *)L->mins + n * L->ng * (L->f32mins ? 4 : 2);
    const int64_t nblocks = L->Kp / 32, bpg = L->G / 32;
    for (int m = 0; m < M; m++) {
        const int8_t *xr = xq + m * L->Kx;
        float y = 0.f;
        for (int64_t b = 0; b < nblocks; b++) {
            const uint8_t *wb = w + b * 16;
            const int8_t *xl = xr + (b / 4) * 128 + (b % 4) * 16, *xh = xl + 64;
            int32_t d = 0;
            for (int j = 0; j < 16; j++) d += (int32_t)(wb[j] & 15) * xl[j] + (int32_t)(wb[j] >> 4) * xh[j];
            y += (float)d * halff(sc[b / bpg], L->f16) * (xb ? xb[m * L->ngp + b] : 1.f);
        }
        y += min_term(mn, xg + m * L->ngp, L->ng, L->f16, L->f32mins, L->sym);
        out[m * ldo + n] = y * xs[m] + (L->bias ? L->bias[n] : 0.f);
    }
}

/* x[k0, k1) quantized with scale s into the staged layout (k0 a multiple of 16), each code's sum added to its group
 * in xg. Division, not a reciprocal (see csrc/quantize_rows.c): the codes must be torch.round(x / s)'s. Runs of
 * 16 weights are contiguous in the staged layout, so they convert and narrow as one vector. */
__attribute__((optimize("no-unsafe-math-optimizations")))
static void stage_span(const float *xr, int64_t k0, int64_t k1, float s, int64_t G, int8_t *dst, float *xg) {
    int64_t k = k0;
#ifdef W4A8_VNNI
    const __m512 sv = _mm512_set1_ps(s);
    for (; k + 16 <= k1; k += 16) {
        __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(xr + k), sv)); /* round half to even */
        _mm_storeu_si128((__m128i *)(dst + (k >> 7) * 128 + ((k >> 4) & 1) * 64 + ((k >> 5) & 3) * 16),
                         _mm512_cvtsepi32_epi8(q));
        xg[k / G] += (float)_mm512_reduce_add_epi32(q);
    }
#elif defined(W4A8_AVX2)
    const __m256 sv = _mm256_set1_ps(s);
    for (; k + 16 <= k1; k += 16) { /* (the scalar loop, other thread idle, was 29% of 1B-shaped GEMVs) */
        const __m256i a = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(xr + k), sv)); /* half to even */
        const __m256i b = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(xr + k + 8), sv));
        const __m128i a16 = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
        const __m128i b16 = _mm_packs_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
        _mm_storeu_si128((__m128i *)(dst + (k >> 7) * 128 + ((k >> 4) & 1) * 64 + ((k >> 5) & 3) * 16),
                         _mm_packs_epi16(a16, b16)); /* (|q| <= 127: the saturating packs are exact) */
        const __m256i ab = _mm256_add_epi32(a, b);
        const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(ab), _mm256_extracti128_si256(ab, 1));
        const __m128i h2 = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
        xg[k / G] += (float)_mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 1)));
    }
#endif
    for (; k < k1; k++) {
        const int8_t q = (int8_t)__builtin_lrintf(xr[k] / s);
        const int64_t i = k & 31; /* position in its 32-weight block */
        dst[(k >> 7) * 128 + (i >> 4) * 64 + ((k >> 5) & 3) * 16 + (i & 15)] = q;
        xg[k / G] += (float)q;
    }
}

static inline float absmax(const float *xr, int64_t k0, int64_t k1) {
    float amax = 0.f;
#pragma omp simd reduction(max : amax)
    for (int64_t k = k0; k < k1; k++) amax = fmaxf(amax, fabsf(xr[k]));
    return amax;
}

/* One row of x quantized and staged (layout above), its per-group sums of xq in xg; returns its scale (also
 * csrc/gemm_a8.c's staging, which reads the same layout). With xb (the
 * activation blocks, G 32): each 32-weight block its own scale, xb[b], zero past the row's blocks to ngp; xg[b] is
 * then that block's sum times its scale, and the row's scale 1. */
__attribute__((optimize("no-unsafe-math-optimizations")))
float w4a8_stage_row(const float *xr, int64_t K, int64_t G, int8_t *dst, int64_t Kx, float *xg, int64_t ngp,
                       float *xb) {
    memset(dst, 0, (size_t)Kx);
    memset(xg, 0, (size_t)ngp * sizeof(float));
    if (!xb) {
        const float amax = absmax(xr, 0, K), s = amax > 0.f ? amax / 127.f : 1.f;
        stage_span(xr, 0, K, s, G, dst, xg);
        return s;
    }
    memset(xb, 0, (size_t)ngp * sizeof(float));
    for (int64_t k0 = 0, b = 0; k0 < K; k0 += 32, b++) {
        const int64_t k1 = k0 + 32 < K ? k0 + 32 : K;
        const float amax = absmax(xr, k0, k1), s = amax > 0.f ? amax / 127.f : 1.f;
        stage_span(xr, k0, k1, s, 32, dst, xg);
        xb[b] = s;
        xg[b] *= s;
    }
    return 1.f;
}

#ifdef W4A8_VNNI
/* Rows whose unmasked loads (up to 16 groups of scales or mins, whole 64-byte chunks) could pass the end. */
static inline int64_t tail_rows_vnni(int64_t Kp, int64_t ng, int64_t ngp, int64_t Kx) {
    return 1 + (ngp + ng - 1) / ng + (Kx / 128 * 64 + Kp / 2 - 1) / (Kp / 2);
}
#endif

/* One-token rows of at least this many weight bytes (Kp / 2) go one by one (row_vnni; AVX2: rows_m1_avx2's one row),
 * the rest gemv_w4a8_pass_rows (4 or 2) a pass (rows_m1_vnni, rows_m1_avx2); never (INT64_MAX) and four until set_gemv_w4a8_seq_bytes and
 * set_gemv_w4a8_pass_rows say otherwise (model/row_order.py times them at start-up). Four interleaved rows a pass
 * stream short rows well with their prefetch two passes ahead, but long rows poorly: on a 2-vCPU Zen 4 (2 threads,
 * 250 MB of weights) one row at a time read 8192-wide rows (4 KiB) 1.4-1.6x as fast and 4096-wide 1.4x, tied at 2048,
 * and lost at 1024 and 576 (0.8-0.9x). On a 2-vCPU Sapphire Rapids-class Xeon two rows a pass, their loads
 * alternating line by line, decoded a 1B model 1.19x as fast as four, one by one 1.18x; on a 2-core AVX2 EPYC two
 * a pass read a 1B-shaped chain 1.11-1.14x as fast as four. (Atomic, both: one engine's
 * start-up may set them while another runs; any mix of them is a valid order, of the same bits.) */
static int64_t gemv_w4a8_seq_bytes = INT64_MAX;
static int gemv_w4a8_pass_rows = 4;

/* Where the passes' prefetch two passes ahead (AVX2: one pass) brings its lines: L1 (0, until
 * set_gemv_w4a8_prefetch_l2 says 1) or L2. On a 2-vCPU Sapphire Rapids-class Xeon into L2 decoded a 1B model 1.035-1.04x as fast (same process,
 * alternating; the same into L1 one pass ahead 1.01x, three or more 0.91-0.96x); model/row_order.py times both. */
static int gemv_w4a8_prefetch_l2 = 0;

int gemv_w4a8_m1_many(float *out, int64_t ldo, const float *x, int64_t ldx, int k, int64_t K, int64_t N,
                      const void *const *w, const void *const *scale, const void *const *mins, int64_t G, int halves,
                      const float *const *bias, float *scratch, int num_threads);

/*
 * y = x W^T + bias for M rows of float32 x (rows ldx floats apart, K used, zero-padded to Kp).
 *   scratch: >= M * (1 + round_up(ng, 16)) floats followed by M * round_up(Kp, 128) bytes (and, with activation
 *   blocks, M * round_up(ng, 16) floats more).
 */
void gemv_w4a8(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
               const void *scale, const void *mins, int64_t G, int halves, const float *bias, float *scratch,
               int num_threads) {
#ifdef W4A8_VNNI
    if (M == 1) { /* one token: one projection of gemv_w4a8_m1_many's (rows in passes, shared by the queue) */
        gemv_w4a8_m1_many(out, ldo, x, 0, 1, K, N, &w, &scale, &mins, G, halves, &bias, scratch, num_threads);
        return;
    }
#endif
    const int64_t Kp = (K + G - 1) / G * G, ng = Kp / G, ngp = (ng + 15) / 16 * 16, Kx = (Kp + 127) / 128 * 128;
    float *xs = scratch, *xg = scratch + M;
    int8_t *xq = (int8_t *)(xg + (int64_t)M * ngp);
    float *xb = (halves >> 3) & 1 ? (float *)(xq + (int64_t)M * Kx) : NULL; /* activation blocks' scales */
    for (int m = 0; m < M; m++)
        xs[m] = w4a8_stage_row(x + m * ldx, K, G, xq + m * Kx, Kx, xg + m * ngp, ngp, xb ? xb + m * ngp : NULL);
    W4A8Layer L = {.w = (const uint8_t *)w, .scale = (const uint16_t *)scale, .mins = mins, .bias = bias,
                   .f16 = halves & 1, .f32mins = (halves >> 1) & 1, .sym = (halves >> 2) & 1, .ablk = xb != NULL,
                   .Kp = Kp, .G = G, .ng = ng, .ngp = ngp, .Kx = Kx};
#ifdef W4A8_VNNI
    const int64_t tail_rows = tail_rows_vnni(Kp, ng, ngp, Kx);
#endif
    /* Rows in chunks to whichever thread asks (csrc/gemv_rows.h), each row's weights prefetched two rows ahead
     * (row_vnni at M > 1): against 2-16 rows of x the arithmetic per weight left the hardware prefetcher behind.
     * Same-process A/B on a Zen 4 EPYC (1B-shaped projections, Q4_0's layout, 2 threads): 1.51x / 1.48x / 1.23x /
     * 1.12x at 2 / 4 / 8 / 16 rows, the prefetch alone 1.14-1.44x. */
#ifdef W4A8_AVX2
    /* One token: the rows a pass, or one by one from a length, and where the prefetch brings its lines, as
     * model/row_order.py set them (read once: a call's rows in one order) */
    const int m1_rows = Kp / 2 >= __atomic_load_n(&gemv_w4a8_seq_bytes, __ATOMIC_RELAXED)
                            ? 1 : __atomic_load_n(&gemv_w4a8_pass_rows, __ATOMIC_RELAXED);
    L.l2 = __atomic_load_n(&gemv_w4a8_prefetch_l2, __ATOMIC_RELAXED);
#endif
    row_queue_t q;
    rq_init(&q, N, num_threads, 4, Kp / 2);
#pragma omp parallel num_threads(num_threads)
    {
#ifdef W4A8_AVX2
        float sf[4 * 2 * (ng + 8)]; /* up to four weight rows' group scales and mins as float (rows_avx2; one row
                                     * and its scaled mins, row_all_tokens_avx2) */
#endif
        int64_t c0, c1;
        while (rq_take(&q, &c0, &c1))
        for (int64_t n = c0; n < c1; n++) {
#ifdef W4A8_AVX2
            if (M > 1 && !(Kp & 63)) { /* several tokens: one weight row against up to 8 of them per pass */
                row_all_tokens_avx2(out, ldo, xq, xs, xg, xb, M, &L, n, sf);
                continue;
            }
#endif
            for (int j = 0; j < M; j += MB) {
                const int mm = M - j < MB ? M - j : MB;
#ifdef W4A8_VNNI
                const float *xgj = xg + j * ngp, *xbj = xb ? xb + j * ngp : NULL;
                const int8_t *xqj = xq + j * Kx;
                float *oj = out + j * ldo;
                const int last = n >= N - tail_rows;
                switch (mm) {
                case 1: row_vnni(oj, ldo, xqj, xs + j, xgj, xbj, 1, &L, n, last); break;
                case 2: row_vnni(oj, ldo, xqj, xs + j, xgj, xbj, 2, &L, n, last); break;
                case 3: row_vnni(oj, ldo, xqj, xs + j, xgj, xbj, 3, &L, n, last); break;
                default: row_vnni(oj, ldo, xqj, xs + j, xgj, xbj, 4, &L, n, last); break;
                }
#elif defined(W4A8_AVX2)
                float *o = out + j * ldo, *xgj = xg + j * ngp, *xbj = xb ? xb + j * ngp : NULL;
                const int8_t *xqj = xq + j * Kx;
                const int64_t end = c1;
                if (M == 1 && !(Kp & 63) && n + m1_rows <= end) { /* one token: m1_rows weight rows a pass */
                    const int64_t ahead = n + 2 * m1_rows <= end ? m1_rows * (Kp / 2) : 0;
#define ROWS_M1(f16, R) rows_m1_avx2(o, xqj, xs[j], xgj, xbj, &L, n, ahead, f16, R)
                    if (L.f16) {
                        if (m1_rows == 4) ROWS_M1(1, 4);
                        else if (m1_rows == 2) ROWS_M1(1, 2);
                        else ROWS_M1(1, 1);
                    } else {
                        if (m1_rows == 4) ROWS_M1(0, 4);
                        else if (m1_rows == 2) ROWS_M1(0, 2);
                        else ROWS_M1(0, 1);
                    }
#undef ROWS_M1
                    n += m1_rows - 1;
                    continue;
                }
                if (M == 1 && n + 4 <= end) {
                    rows_avx2(o, ldo, xqj, xs + j, xgj, xbj, 1, &L, n, 4, sf);
                    n += 3;
                    continue;
                }
                switch (mm) {
                case 1: rows_avx2(o, ldo, xqj, xs + j, xgj, xbj, 1, &L, n, 1, sf); break;
                case 2: rows_avx2(o, ldo, xqj, xs + j, xgj, xbj, 2, &L, n, 1, sf); break;
                case 3: rows_avx2(o, ldo, xqj, xs + j, xgj, xbj, 3, &L, n, 1, sf); break;
                default: rows_avx2(o, ldo, xqj, xs + j, xgj, xbj, 4, &L, n, 1, sf); break;
                }
#else
                row_portable(out + j * ldo, ldo, xq + j * Kx, xs + j, xg + j * ngp, xb ? xb + j * ngp : NULL, mm, &L,
                             n);
#endif
            }
        }
    }
}

void set_gemv_w4a8_prefetch_l2(int l2) { __atomic_store_n(&gemv_w4a8_prefetch_l2, l2 != 0, __ATOMIC_RELAXED); }

void set_gemv_w4a8_seq_bytes(int64_t bytes) { __atomic_store_n(&gemv_w4a8_seq_bytes, bytes, __ATOMIC_RELAXED); }

void set_gemv_w4a8_pass_rows(int rows) { __atomic_store_n(&gemv_w4a8_pass_rows, rows == 2 ? 2 : 4, __ATOMIC_RELAXED); }

/* Whether a one-token call's rows of row_bytes weight bytes go one by one (the kernel's own test, exported). */
int gemv_w4a8_one_by_one(int64_t row_bytes) {
    return row_bytes >= __atomic_load_n(&gemv_w4a8_seq_bytes, __ATOMIC_RELAXED);
}

/* The one-token order W4A8's rows of row_bytes weight bytes take now: rows a pass (gemv_w4a8_pass_rows, or 1 from
 * gemv_w4a8_seq_bytes on), and in *l2 the level their prefetch brings lines to. int4's rows against a bf16 x
 * (csrc/gemv_int4_bf16dot.h) read the same layout the same way, and follow it. */
int gemv_w4a8_m1_order(int64_t row_bytes, int *l2) {
    *l2 = __atomic_load_n(&gemv_w4a8_prefetch_l2, __ATOMIC_RELAXED);
    return row_bytes >= __atomic_load_n(&gemv_w4a8_seq_bytes, __ATOMIC_RELAXED)
               ? 1 : __atomic_load_n(&gemv_w4a8_pass_rows, __ATOMIC_RELAXED);
}

/* Whether W4A8's one-token rows follow gemv_w4a8_seq_bytes and gemv_w4a8_pass_rows here (the AVX-512 VNNI path): where not, timing its
 * layers both ways would only measure noise. */
int gemv_w4a8_rows_ordered(void) {
#if defined(W4A8_VNNI) || defined(W4A8_AVX2)
    return 1;
#else
    return 0;
#endif
}

/*
 * k one-token projections of one shape (K, N, G and scale types alike) in one parallel region: row n of output j,
 * out[j * ldo + n], is x_j W_j[n]^T + bias_j[n], x_j = x + j * ldx (ldx 0: one x for all, staged once). A mixture's
 * chosen experts at one decoding token (csrc/moe_decode.c): their gate_up rows in one region, then their down rows,
 * where one region per expert and projection made five regions a layer of <= 50 us of work each, the second thread
 * waiting at every end (libgomp's spin: 18% of the samples). Returns 0 where it has no such path (no VNNI,
 * k > MAX_M): the caller runs them one by one. w, scale, mins, bias: k pointers each (bias may be NULL).
 * scratch: as gemv_w4a8's for M = k rows.
 */
int gemv_w4a8_m1_many(float *out, int64_t ldo, const float *x, int64_t ldx, int k, int64_t K, int64_t N,
                      const void *const *w, const void *const *scale, const void *const *mins, int64_t G, int halves,
                      const float *const *bias, float *scratch, int num_threads) {
#ifdef W4A8_VNNI
    if (k < 1 || k > 16) return 0;
    const int64_t Kp = (K + G - 1) / G * G, ng = Kp / G, ngp = (ng + 15) / 16 * 16, Kx = (Kp + 127) / 128 * 128;
    const int staged = ldx ? k : 1;
    float *xs = scratch, *xg = scratch + staged;
    int8_t *xq = (int8_t *)(xg + (int64_t)staged * ngp);
    float *xb = (halves >> 3) & 1 ? (float *)(xq + (int64_t)staged * Kx) : NULL; /* activation blocks' scales */
    for (int j = 0; j < staged; j++)
        xs[j] = w4a8_stage_row(x + j * ldx, K, G, xq + j * Kx, Kx, xg + j * ngp, ngp, xb ? xb + j * ngp : NULL);
    W4A8Layer L[16];
    for (int j = 0; j < k; j++)
        L[j] = (W4A8Layer){.w = (const uint8_t *)w[j], .scale = (const uint16_t *)scale[j], .mins = mins[j],
                           .bias = bias ? bias[j] : NULL, .f16 = halves & 1, .f32mins = (halves >> 1) & 1,
                           .sym = (halves >> 2) & 1, .ablk = xb != NULL, .Kp = Kp, .G = G, .ng = ng, .ngp = ngp,
                           .Kx = Kx};
    const int64_t tail_rows = tail_rows_vnni(Kp, ng, ngp, Kx);
    /* The k projections' rows as one range, each projection's padded to whole passes of four (Np rows, those past
     * N skipped) so its rows fall into passes as one projection's do (a pass of two: two of them). */
    const int64_t Np = (N + 3) / 4 * 4;
    const int one_by_one = gemv_w4a8_one_by_one(Kp / 2); /* (read once: a call's rows in one order) */
    const int pass_rows = __atomic_load_n(&gemv_w4a8_pass_rows, __ATOMIC_RELAXED);
    const int l2 = __atomic_load_n(&gemv_w4a8_prefetch_l2, __ATOMIC_RELAXED);
    for (int j = 0; j < k; j++) L[j].l2 = l2;
    row_queue_t q;
    rq_init(&q, Np * k, num_threads, 4, Kp / 2);
#pragma omp parallel num_threads(num_threads)
    {
        int64_t at, c_end, n, end;
        int j;
        while (rq_take(&q, &at, &c_end))
        while (rq_span(&at, c_end, Np, N, &j, &n, &end)) { /* (a piece may run from one projection into the next) */
            const int x_at = ldx ? j : 0;
            const int64_t lim = N - tail_rows;
            const int8_t *xqj = xq + x_at * Kx;
            const float *xgj = xg + x_at * ngp, *xbj = xb ? xb + x_at * ngp : NULL;
            float *o = out + j * ldo;
            if (pass_rows == 2)
                for (; !one_by_one && n + 2 <= end && n + 2 <= lim; n += 2)
                    rows_m1_vnni(o, xqj, xs[x_at], xgj, xbj, &L[j], n, n + 6 <= lim, 2);
            else
                for (; !one_by_one && n + 4 <= end && n + 4 <= lim; n += 4)
                    rows_m1_vnni(o, xqj, xs[x_at], xgj, xbj, &L[j], n, n + 12 <= lim, 4);
            for (; n < end; n++) row_vnni(o, ldo, xqj, xs + x_at, xgj, xbj, 1, &L[j], n, n >= lim);
        }
    }
    return 1;
#else
    (void)out, (void)ldo, (void)x, (void)ldx, (void)k, (void)K, (void)N, (void)w, (void)scale, (void)mins, (void)G;
    (void)halves, (void)bias, (void)scratch, (void)num_threads;
    return 0;
#endif
}
