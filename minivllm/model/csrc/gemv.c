/*
 * Linear layers for a few tokens at a time (decode): y[M, N] = x[M, K] W^T (+ bias), reading each weight
 * once for all M rows of x. At small M these layers are a pass over the weights, bound by memory
 * bandwidth, so the weights stay in memory as compact as their format allows and are widened in
 * registers. x and y are float32.
 *
 * Weight formats (row n of W is output channel n):
 *   f32    w [N, K] float32
 *   bf16   w [N, K] bfloat16 bits
 *   int8   w [N, K] int8, per-channel scale s[n]:                 W[n, k] = s[n] * w[n, k]
 *   int4   w [N, Kp / 2] uint8, Kp = K rounded up to the group size G (a multiple of 32), per-group
 *          scale and min as bf16 [N, Kp / G]:                    W[n, k] = scale * q + min, q in 0..15;
 *          or as float16 (fmt | FMT_F16_SCALES), the mins as float32 (fmt | FMT_F32_MINS): GGUF's Q4_0 / Q4_1
 *          and GPTQ / AWQ / compressed-tensors checkpoints keep their scales (and -scale * zero) exactly so;
 *          | FMT_SYM_MINS: no mins stored, each is -8 * scale (Q4_0's blocks: 18 bytes per 32 weights, not 20).
 *          Each 32-weight block is 16 bytes; byte j holds q[j] (low nibble) and q[j + 16] (high
 *          nibble), so one 16-byte load widens to two 16-lane vectors without shuffles.
 *   w8a8   the int8 weights; x is quantized per row here (symmetric, absmax / 127, round half to
 *          even as torch.round): y[m, n] = xs[m] * s[n] * sum_k xq[m, k] w[n, k], exact in int32.
 *   w4a8   the int4 weights against x quantized as for w8a8 (csrc/gemv_w4a8.c; from 17 rows of x on, all rows at
 *          once as a tiled GEMM, csrc/gemm_a8.c); | FMT_ACT_BLOCKS (groups of 32): x quantized per 32-weight block
 *          instead, each its own scale (llama.cpp's Q8_0 activations).
 *   q8     w [N, Kp] int8 in blocks of 32, a float16 scale each (GGUF's Q8_0); q8a8 the same against int8 x
 *          (csrc/gemv_q8.c), | FMT_ACT_BLOCKS: x's blocks of 32 each their own scale.
 *   q6k    w [N, K / 256 * 210] uint8: GGUF's Q6_K superblocks as the file holds them (csrc/gemv_q6k.c; K a
 *          multiple of 256), weight-only, | FMT_ACT_BLOCKS: against x in blocks of 32.
 *   q4k    w [N, K / 256 * 144] uint8: GGUF's Q4_K superblocks as the file holds them (csrc/gemv_q4k.c), the same.
 *
 * Each thread walks its share of N one weight row at a time, with two accumulators per row of x so the FMA
 * chains overlap; at one token the float formats take four or eight weight rows per pass instead (each load of
 * x serving them all: 1.2-1.5x the one-row pass on an AVX2 EPYC, see dense_rows_m1; rows one by one where
 * or two a pass, where start-up timing finds that faster: gemv_m1_order), and the one-token paths
 * share rows out as csrc/gemv_rows.h's queue does (rq_take). Rows of x come in chunks of up to MB, each
 * chunk size compiled on its own so the accumulators live in registers. GCC vector extensions:
 * AVX-512 where the CPU has it, narrower registers elsewhere; only the byte-widening loads use
 * intrinsics (GCC 12 scalarises __builtin_convertvector from 8-bit lanes).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
#define INLINE static inline __attribute__((always_inline))
#define MAX_M 16 /* rows of x staged per pass (scratch layout) */
#define MB 4     /* rows of x per register block */
#include "gemv_rows.h"

INLINE v16 ld16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE v16 ld16_bf16(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    v16u u = __builtin_convertvector(h, v16u) << 16; /* bf16 bits are a float's upper half */
    v16 f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* 16 signed bytes → 16 int32 lanes. */
INLINE v16i widen_s8(const int8_t *p) {
#if defined(__AVX512F__)
    return (v16i)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i lo = _mm256_cvtepi8_epi32(b), hi = _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8));
    v16i r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
#else
    v16i r;
    for (int i = 0; i < 16; i++) r[i] = p[i];
    return r;
#endif
}

/* 16 unsigned bytes → 16 int32 lanes. */
INLINE v16i widen_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i lo = _mm256_cvtepu8_epi32(b), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    v16i r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
#else
    v16i r;
    for (int i = 0; i < 16; i++) r[i] = p[i];
    return r;
#endif
}

INLINE float hsum(v16 v) {
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A group scale or min: bfloat16 or (f16) float16 bits. */
INLINE float half_to_f32(uint16_t h, int f16) {
    if (!f16) return bf16_to_f32(h);
    _Float16 v;
    memcpy(&v, &h, sizeof v);
    return (float)v;
}

/* Everything a row kernel needs besides the row index and the chunk of x. */
typedef struct {
    const void *w;
    int64_t K, Kv; /* Kv: floats (or bytes) between staged rows of x */
    const void *scale, *mins; /* per format */
    int64_t G;
    const float *bias;
    int f16, f32mins; /* int4 group scales (and mins) are float16, else bfloat16; mins are float32 */
    int sym;          /* no mins stored: each is -8 scale (codes centred on 8: GGUF's Q4_0, symmetric GPTQ) */
    int64_t pf;       /* one-token rows: bytes ahead of each load prefetched into L2 (gemv_m1_prefetch; 0: none) */
} Layer;

int gemv_m1_order = 0; /* M1_PASS (see gemv_m1.h) until set_gemv_m1_order says otherwise */

void set_gemv_m1_order(int order) { __atomic_store_n(&gemv_m1_order, order, __ATOMIC_RELAXED); }

/* The order the one-token rows take now (M1_PASS and M1_PAIRS give the same bits: tests read it here). */
int gemv_m1_order_now(void) { return __atomic_load_n(&gemv_m1_order, __ATOMIC_RELAXED); }

/* 0 until set_gemv_m1_prefetch says otherwise. The hardware prefetcher alone left these rows' loads waiting on a
 * 2-vCPU Sapphire Rapids-class Xeon: a 1B model's one-token decode stack ran W8A8 1.12x and bf16 (dot-product rows)
 * 1.04x as fast with each 64 bytes' line 8 KiB / 4 KiB on requested into L2 (same process, alternating), f32 0.97-0.99x
 * (so each model's start-up timing decides; into L1 instead, W8A8 gained a third as much). Any value gives the same
 * bits. */
int64_t gemv_m1_prefetch = 0;

void set_gemv_m1_prefetch(int64_t bytes) { __atomic_store_n(&gemv_m1_prefetch, bytes, __ATOMIC_RELAXED); }

/* Float rows of at most this many weights (K) go one by one at 2..FEW_ROWS_MAX_M tokens (csrc/gemv_avx512.h's
 * dense_row1_avx512) rather than several a pass; 0 (never) until set_gemv_few_rows_k says otherwise
 * (model/row_order.py times it per row length at start-up). */
int64_t gemv_few_rows_k = 0;

void set_gemv_few_rows_k(int64_t k) { __atomic_store_n(&gemv_few_rows_k, k, __ATOMIC_RELAXED); }

#include "gemv_m1.h"
#include "gemv_bf16dot.h"

/* Float weights (f32 or bf16) against M rows of x. */
INLINE void dense_row(float *out, int64_t ldo, const float *x, int M, const Layer *L, int bf16, int64_t n) {
    const int64_t K = L->K;
    v16 a0[MB], a1[MB];
    memset(a0, 0, sizeof a0);
    memset(a1, 0, sizeof a1);
    const float *wf = (const float *)L->w + n * K;
    const uint16_t *wh = (const uint16_t *)L->w + n * K;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        v16 w0 = bf16 ? ld16_bf16(wh + k) : ld16(wf + k), w1 = bf16 ? ld16_bf16(wh + k + 16) : ld16(wf + k + 16);
        for (int m = 0; m < M; m++) {
            a0[m] += ld16(x + m * L->Kv + k) * w0;
            a1[m] += ld16(x + m * L->Kv + k + 16) * w1;
        }
    }
    for (; k + 16 <= K; k += 16) {
        v16 w0 = bf16 ? ld16_bf16(wh + k) : ld16(wf + k);
        for (int m = 0; m < M; m++) a0[m] += ld16(x + m * L->Kv + k) * w0;
    }
    for (int m = 0; m < M; m++) {
        float s = hsum(a0[m] + a1[m]);
        for (int64_t j = k; j < K; j++) s += x[m * L->Kv + j] * (bf16 ? bf16_to_f32(wh[j]) : wf[j]);
        out[m * ldo + n] = s + (L->bias ? L->bias[n] : 0.f);
    }
}

INLINE void int8_row(float *out, int64_t ldo, const float *x, int M, const Layer *L, int64_t n) {
    const int64_t K = L->K;
    const int8_t *w = (const int8_t *)L->w + n * K;
    v16 a0[MB], a1[MB];
    memset(a0, 0, sizeof a0);
    memset(a1, 0, sizeof a1);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        v16 w0 = __builtin_convertvector(widen_s8(w + k), v16), w1 = __builtin_convertvector(widen_s8(w + k + 16), v16);
        for (int m = 0; m < M; m++) {
            a0[m] += ld16(x + m * L->Kv + k) * w0;
            a1[m] += ld16(x + m * L->Kv + k + 16) * w1;
        }
    }
    for (; k + 16 <= K; k += 16) {
        v16 w0 = __builtin_convertvector(widen_s8(w + k), v16);
        for (int m = 0; m < M; m++) a0[m] += ld16(x + m * L->Kv + k) * w0;
    }
    float sc = ((const float *)L->scale)[n];
    for (int m = 0; m < M; m++) {
        float s = hsum(a0[m] + a1[m]);
        for (int64_t j = k; j < K; j++) s += x[m * L->Kv + j] * (float)w[j];
        out[m * ldo + n] = s * sc + (L->bias ? L->bias[n] : 0.f);
    }
}

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

#if defined(__AVX2__)
/* 32 int8 weights (wv, and wa = |wv|) against 32 int8 activations at x: 8 int32 sums of 4 products each, added
 * to acc. |w| (unsigned) times x carrying w's sign (x within +-127: negation cannot overflow): with VNNI one
 * vpdpbusd at 256 bits (AVX512-VNNI's VL form or AVX-VNNI); without it vpmaddubsw (pairs at most 2 * 128 * 127,
 * no int16 saturation) widened by vpmaddwd against ones, then an add: 4 instructions where VNNI takes 2. Exact. */
INLINE __m256i s8_dot32_acc(__m256i acc, __m256i wa, __m256i wv, const int8_t *x) {
    const __m256i xw = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), wv);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, wa, xw);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, wa, xw);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xw), _mm256_set1_epi16(1)));
#endif
}
#endif

/* The SIMD float rows' last step (csrc/gemv_avx2.h, csrc/gemv_avx512.h): s[r * M + m], the reduced sums of weight
 * rows n + r against tokens m over the first k of K, plus the columns past k, plus the bias, into out. */
INLINE void dense_rows_store(float *out, int64_t ldo, const float *x, int M, int R, const Layer *L, int bf16,
                             int64_t n, int64_t k, const float *s) {
    const int64_t K = L->K;
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) {
            float y = s[r * M + m];
            for (int64_t j = k; j < K; j++) {
                const float wj = bf16 ? bf16_to_f32(((const uint16_t *)L->w)[(n + r) * K + j])
                                      : ((const float *)L->w)[(n + r) * K + j];
                y += x[m * L->Kv + j] * wj;
            }
            out[m * ldo + n + r] = y + (L->bias ? L->bias[n + r] : 0.f);
        }
}

#include "gemv_avx2.h"
#include "gemv_avx512.h"
#include "gemv_int4_bf16dot.h"
#include "gemv_int4_int16dot.h"

/* Whether the one-token int8 rows follow gemv_m1_order here (AVX-512 VNNI's: W8A8's per-channel rows, and GGUF's
 * Q8_0 / Q4_K / Q6_K rows against x in blocks, csrc/gemv_q8.c, gemv_q4k.c, gemv_q6k.c, built on the same condition):
 * where not, timing their layers each way would only measure noise. */
int gemv_w8a8_rows_ordered(void) {
#ifdef GEMV_W8A8_M1_VNNI
    return 1;
#else
    return 0;
#endif
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

/* Whether int4's one-token rows take a float32 x as int16 in blocks of 32 here (csrc/gemv_avx2.h: AVX2 without VNNI;
 * csrc/gemv_int4_int16dot.h: AVX512-VNNI). */
int gemv_int4_x_int16(void) {
#ifdef INT4_M1_X_INT16
    return 1;
#else
    return 0;
#endif
}

/* Whether the few-token float rows follow gemv_few_rows_k here (AVX-512's rows; AVX2's and the generic ones do not). */
int gemv_few_rows_ordered(void) {
#ifdef GEMV_DENSE_AVX512
    return 1;
#else
    return 0;
#endif
}

/* x here is the int8 quantized rows (Kv bytes apart), xs their scales. With AVX512-VNNI, vpdpbusd sums
 * 64 byte products per instruction; it takes one unsigned operand, so x is shifted to x + 128 (a
 * sign-bit flip) and 128 * sum(w), summed by the same instruction against a vector of ones, is taken
 * off again: exact, like the widening path. */
INLINE void w8a8_row(float *out, int64_t ldo, const int8_t *xq, const float *xs, int M, const Layer *L, int64_t n) {
    const int64_t K = L->K;
    const int8_t *w = (const int8_t *)L->w + n * K;
    v16i acc[MB];
    memset(acc, 0, sizeof acc);
    int64_t k = 0, wsum = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const __m512i flip = _mm512_set1_epi8((char)0x80), ones = _mm512_set1_epi8(1);
    __m512i wacc = _mm512_setzero_si512();
    for (; k + 64 <= K; k += 64) {
        __m512i wv = _mm512_loadu_si512((const void *)(w + k));
        wacc = _mm512_dpbusd_epi32(wacc, ones, wv);
        for (int m = 0; m < M; m++) {
            __m512i xu = _mm512_xor_si512(_mm512_loadu_si512((const void *)(xq + m * L->Kv + k)), flip);
            acc[m] = (v16i)_mm512_dpbusd_epi32((__m512i)acc[m], xu, wv);
        }
    }
    wsum = _mm512_reduce_add_epi32(wacc);
#elif defined(__AVX2__)
    /* s8_dot32_acc (exact): 3-4x the widening loop. */
    __m256i acc8[MB];
    for (int m = 0; m < M; m++) acc8[m] = _mm256_setzero_si256();
    for (; k + 32 <= K; k += 32) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k)), wa = _mm256_sign_epi8(wv, wv);
        for (int m = 0; m < M; m++) acc8[m] = s8_dot32_acc(acc8[m], wa, wv, xq + m * L->Kv + k);
    }
    for (int m = 0; m < M; m++) {
        int32_t v[8];
        _mm256_storeu_si256((__m256i *)v, acc8[m]);
        for (int i = 0; i < 8; i++) acc[m][i] += v[i];
    }
#endif
    for (; k + 16 <= K; k += 16) {
        v16i wv = widen_s8(w + k);
        for (int m = 0; m < M; m++) acc[m] += widen_s8(xq + m * L->Kv + k) * wv;
    }
    float sc = ((const float *)L->scale)[n];
    for (int m = 0; m < M; m++) {
        int64_t s = -128 * wsum;
        for (int i = 0; i < 16; i++) s += acc[m][i];
        for (int64_t j = k; j < K; j++) s += (int32_t)xq[m * L->Kv + j] * w[j];
        out[m * ldo + n] = (float)s * xs[m] * sc + (L->bias ? L->bias[n] : 0.f);
    }
}

/* csrc/quantize_rows.c: one row of x as int8 codes (absmax / 127, round half to even); returns the scale */
float quantize_row_s8(const float *xr, int64_t K, int8_t *xq);

enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_INT8 = 2, FMT_INT4 = 3, FMT_W8A8 = 4, FMT_W4A8 = 5, FMT_Q8 = 6, FMT_Q8A8 = 7,
       FMT_Q6K = 8, FMT_Q4K = 9,
       FMT_F16_SCALES = 16, FMT_F32_MINS = 32, FMT_SYM_MINS = 64, FMT_ACT_BLOCKS = 128 };

/* csrc/gemv_w4a8.c */
/* W4A8's one-token order for rows of row_bytes (csrc/gemv_w4a8.c): rows a pass (4, 2 or 1), *l2 its prefetch's level. */
int gemv_w4a8_m1_order(int64_t row_bytes, int *l2);
void gemv_w4a8(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
               const void *scale, const void *mins, int64_t G, int halves, const float *bias, float *scratch,
               int num_threads);
int gemv_w4a8_m1_many(float *out, int64_t ldo, const float *x, int64_t ldx, int k, int64_t K, int64_t N,
                      const void *const *w, const void *const *scale, const void *const *mins, int64_t G, int halves,
                      const float *const *bias, float *scratch, int num_threads);
/* csrc/gemm_a8.c: W4A8 and q8a8 at many tokens, all rows at once (0 where it has no path) */
int gemm_w4a8(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
              const void *scale, const void *mins, int64_t G, int halves, const float *bias, int num_threads);
int gemm_q8a8(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
              const void *scale, const float *bias, int ablk, int num_threads);
int gemm_q6k(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
             const float *bias, int num_threads);
int gemm_q4k(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
             const float *bias, int num_threads);
/* Q6_K's rows convert and scale every 64 codes for each row of x, its tiles (two conversions a block) every 16 weight
 * rows: the 1B head (128256 x 2048, a Zen 4 EPYC, 2 threads) ran 8 / 12 / 16 rows of x in ~20 / ~30 / 40.7 ms as
 * rows, 26.0 / 30.1 / 33.4 as tiles. */
#define Q6K_GEMM_MIN_M 12
/* Q4_K's: the tiles' speed over the rows' on a 1B layer's four shapes (Zen 4 EPYC, 2 threads, 7 interleaved rounds)
 * 0.90 / 1.03 / 1.09 at 12 / 14 / 16 rows of x */
#define Q4K_GEMM_MIN_M 14
#ifndef GEMM_A8_MIN_M /* below it the rows win: the tiles' repacking costs as much as 2-8 rows of x (1B shapes) */
#define GEMM_A8_MIN_M 17
#endif
/* csrc/gemv_q8.c: int8 weights in blocks of 32 with float16 scales (GGUF's Q8_0), weight-only or a8 */
void gemv_q8(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
             const void *scale, const float *bias, int a8, float *scratch, int num_threads);

/* csrc/gemv_q6k.c: GGUF's Q6_K superblocks, weight-only or against x in blocks of 32 (a8) */
void gemv_q6k(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
              const float *bias, int a8, float *scratch, int num_threads);
/* csrc/gemv_q4k.c: GGUF's Q4_K superblocks, the same */
void gemv_q4k(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
              const float *bias, int a8, float *scratch, int num_threads);

/*
 * y = x W^T + bias for one of the formats above.
 *   out [M, N] rows ldo floats apart; x [M, K] rows ldx floats apart (unit column stride)
 *   fmt: FMT_*; int4 and w4a8 | FMT_F16_SCALES for float16 scales (and mins), | FMT_F32_MINS for float32 mins
 *   w, scale, mins, G as the format says (unused ones may be NULL / 0)
 *   scratch: float32, >= MAX_M * (Kp + 2 Kp / G + 64) floats (staged, padded or quantized rows of x)
 */
void linear_gemv(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, int fmt,
                 const void *w, const void *scale, const void *mins, int64_t G, const float *bias, float *scratch,
                 int num_threads) {
    /* bit 0: f16 scales, bit 1: f32 mins, bit 2: no mins (-8 scale), bit 3: w4a8's x in blocks of 32 */
    const int halves = (fmt & (FMT_F16_SCALES | FMT_F32_MINS | FMT_SYM_MINS | FMT_ACT_BLOCKS)) / FMT_F16_SCALES;
    fmt &= ~(FMT_F16_SCALES | FMT_F32_MINS | FMT_SYM_MINS | FMT_ACT_BLOCKS);
    Layer L = {.w = w, .K = K, .Kv = ldx, .scale = scale, .mins = mins, .G = G, .bias = bias, .f16 = halves & 1,
               .pf = M == 1 ? __atomic_load_n(&gemv_m1_prefetch, __ATOMIC_RELAXED) : 0,
               .f32mins = (halves >> 1) & 1, .sym = (halves >> 2) & 1};
    if (fmt == FMT_W4A8 && M >= GEMM_A8_MIN_M &&
        gemm_w4a8(out, ldo, x, ldx, M, K, N, w, scale, mins, G, halves, bias, num_threads))
        return;
    if (fmt == FMT_Q8A8 && M >= GEMM_A8_MIN_M &&
        gemm_q8a8(out, ldo, x, ldx, M, K, N, w, scale, bias, (halves >> 3) & 1, num_threads))
        return;
    if (fmt == FMT_Q6K && (halves >> 3) & 1 && M >= Q6K_GEMM_MIN_M &&
        gemm_q6k(out, ldo, x, ldx, M, K, N, w, bias, num_threads))
        return;
    if (fmt == FMT_Q4K && (halves >> 3) & 1 && M >= Q4K_GEMM_MIN_M &&
        gemm_q4k(out, ldo, x, ldx, M, K, N, w, bias, num_threads))
        return;
    for (int m0 = 0; m0 < M; m0 += MAX_M) {
        int mm = M - m0 < MAX_M ? M - m0 : MAX_M;
        const float *xm = x + m0 * ldx;
        float *o = out + m0 * ldo;
        if (fmt == FMT_Q6K) {
            gemv_q6k(o, ldo, xm, ldx, mm, K, N, w, bias, (halves >> 3) & 1, scratch, num_threads);
        } else if (fmt == FMT_Q4K) {
            gemv_q4k(o, ldo, xm, ldx, mm, K, N, w, bias, (halves >> 3) & 1, scratch, num_threads);
        } else if (fmt == FMT_Q8 || fmt == FMT_Q8A8) {
            const int a8 = fmt == FMT_Q8A8 ? 1 + ((halves >> 3) & 1) : 0; /* 2: x in blocks of 32 */
            gemv_q8(o, ldo, xm, ldx, mm, K, N, w, scale, bias, a8, scratch, num_threads);
        } else if (fmt == FMT_W4A8) {
            gemv_w4a8(o, ldo, xm, ldx, mm, K, N, w, scale, mins, G, halves, bias, scratch, num_threads);
        } else if (fmt == FMT_INT4) {
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
                int l2 = 0; /* (the bf16 and int16 rows: a pass's rows and the prefetch's level as W4A8's, read once) */
                const int rows = dot || i16 ? gemv_w4a8_m1_order(Kp / 2, &l2) : 1;
                const uint16_t *xb = (const uint16_t *)scratch;
                row_queue_t q;
                rq_init(&q, N, num_threads, rows, Kp / 2);
#if defined(GEMV_INT4_INT16DOT)
#define INT4_ROWS_M1(R, ahead) \
    (i16 ? int4_rows_m1_int16(o, scratch, xg, &L, n, R, ahead, l2) : int4_rows_m1_bf16dot(o, xb, xg, &L, n, R, ahead, l2))
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
                            if (dot || i16) INT4_ROWS_M1(1, 0);
                            else INT4_M1_ROW(o, scratch, xg, &L, n);
                        }
                    }
                }
#undef INT4_ROWS_M1
                continue;
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
        } else if (fmt == FMT_W8A8) {
            float *xs = scratch;
            int8_t *xq = (int8_t *)(scratch + MAX_M);
            for (int m = 0; m < mm; m++) xs[m] = quantize_row_s8(xm + m * ldx, K, xq + m * K);
            L.Kv = K;
#ifdef GEMV_W8A8_M1_VNNI
            if (mm == 1) {
                int32_t xsum = 0;
                for (int64_t k = 0; k < K; k++) xsum += xq[k];
                row_queue_t q;
                rq_init(&q, N, num_threads, 4, K);
                const int order = __atomic_load_n(&gemv_m1_order, __ATOMIC_RELAXED);
#pragma omp parallel num_threads(num_threads)
                w8a8_m1_vnni(o, xq, xs[0], xsum, &L, &q, order);
                continue;
            }
#endif
#ifdef GEMV_AVX2
#pragma omp parallel num_threads(num_threads)
            w8a8_rows_avx2(o, ldo, xq, xs, mm, &L, N);
#else
#define RW(c) w8a8_row(o + j * ldo, ldo, xq + j * K, xs + j, c, &L, n)
#pragma omp parallel num_threads(num_threads)
            FOR_ROWS(N, mm, RW);
#endif
        } else if (fmt == FMT_INT8) {
#ifdef GEMV_AVX2
#define R8(c) int8_row_avx2(o + j * ldo, ldo, xm + j * ldx, c, &L, n)
#else
#define R8(c) int8_row(o + j * ldo, ldo, xm + j * ldx, c, &L, n)
#endif
#pragma omp parallel num_threads(num_threads)
            FOR_ROWS(N, mm, R8);
        } else if (mm == 1) {
            const int bf16 = fmt == FMT_BF16;
            const int dot = bf16 && bf16_exact(xm, K); /* (x a bf16 model's: vdpbf16ps, gemv_bf16dot.h) */
            if (dot) bf16_pack_x((uint16_t *)scratch, xm, K);
            else if (bf16) bf16_split_x(scratch, xm, K);
            row_queue_t q;
            rq_init(&q, N, num_threads, M1_ROWS, K * (bf16 ? 2 : 4));
            const int order = __atomic_load_n(&gemv_m1_order, __ATOMIC_RELAXED);
#pragma omp parallel num_threads(num_threads)
            {
                int64_t n, end;
                while (rq_take(&q, &n, &end)) {
                    for (; n + M1_ROWS <= end; n += M1_ROWS) {
                        if (dot) bf16dot_rows(o, (const uint16_t *)scratch, &L, n, order);
                        else if (bf16) bf16_rows_m1(o, xm, scratch, &L, n, order);
                        else dense_rows_m1(o, xm, &L, n, order);
                    }
                    for (; n < end; n++) {
                        if (dot) bf16dot_row(o, (const uint16_t *)scratch, &L, n);
                        else if (bf16) bf16_row_m1(o, xm, scratch, &L, n);
                        else dense_row_m1(o, xm, &L, n);
                    }
                }
            }
        } else if (fmt == FMT_BF16) {
#if defined(GEMV_DENSE_AVX512)
            row_queue_t q;
            rq_init(&q, N, num_threads, 8, K * 2);
            const int one = mm <= FEW_ROWS_MAX_M && K <= __atomic_load_n(&gemv_few_rows_k, __ATOMIC_RELAXED);
#pragma omp parallel num_threads(num_threads)
            dense_all_avx512(o, ldo, xm, mm, &L, 1, &q, one);
#elif defined(GEMV_AVX2)
#pragma omp parallel num_threads(num_threads)
            dense_all_avx2(o, ldo, xm, mm, &L, 1, N);
#else
#define RB(c) dense_row(o + j * ldo, ldo, xm + j * ldx, c, &L, 1, n)
#pragma omp parallel num_threads(num_threads)
            FOR_ROWS(N, mm, RB);
#endif
        } else {
#if defined(GEMV_DENSE_AVX512)
            row_queue_t q;
            rq_init(&q, N, num_threads, 8, K * 4);
            const int one = mm <= FEW_ROWS_MAX_M && K <= __atomic_load_n(&gemv_few_rows_k, __ATOMIC_RELAXED);
#pragma omp parallel num_threads(num_threads)
            dense_all_avx512(o, ldo, xm, mm, &L, 0, &q, one);
#elif defined(GEMV_AVX2)
#pragma omp parallel num_threads(num_threads)
            dense_all_avx2(o, ldo, xm, mm, &L, 0, N);
#else
#define RF(c) dense_row(o + j * ldo, ldo, xm + j * ldx, c, &L, 0, n)
#pragma omp parallel num_threads(num_threads)
            FOR_ROWS(N, mm, RF);
#endif
        }
    }
}

/* k float32 projections at one token each in one region (linear_gemv_m1_many, below): each row computed as
 * linear_gemv's one-token f32 path computes it (dense_rows_m1 / dense_row_m1), the k projections' rows shared out
 * as one range (csrc/gemv_rows.h's queue). */
static int dense_m1_many(float *out, int64_t ldo, const float *x, int64_t ldx, int k, int64_t K, int64_t N,
                         const void *const *w, const float *const *bias, int num_threads) {
    if (k < 1 || k > 16) return 0;
    Layer L[16];
    const int64_t pf = __atomic_load_n(&gemv_m1_prefetch, __ATOMIC_RELAXED);
    for (int j = 0; j < k; j++) L[j] = (Layer){.w = w[j], .K = K, .Kv = K, .bias = bias ? bias[j] : NULL, .pf = pf};
    /* The k projections' rows as one range, each projection's padded to whole passes (Np rows, those past N
     * skipped) so its rows fall into passes as linear_gemv's one projection does (equal bits). */
    const int64_t Np = (N + M1_ROWS - 1) / M1_ROWS * M1_ROWS;
    row_queue_t q;
    rq_init(&q, Np * k, num_threads, M1_ROWS, K * 4);
    const int order = __atomic_load_n(&gemv_m1_order, __ATOMIC_RELAXED);
#pragma omp parallel num_threads(num_threads)
    {
        int64_t at, c_end, n, end;
        int j;
        while (rq_take(&q, &at, &c_end))
        while (rq_span(&at, c_end, Np, N, &j, &n, &end)) { /* (a piece may run from one projection into the next) */
            const float *xj = x + j * ldx;
            float *o = out + j * ldo;
            for (; n + M1_ROWS <= end; n += M1_ROWS) dense_rows_m1(o, xj, &L[j], n, order);
            for (; n < end; n++) dense_row_m1(o, xj, &L[j], n);
        }
    }
    return 1;
}

/*
 * k projections of one shape and format at one token each (w, scale, mins, bias: k pointers each; bias may be NULL)
 * in one parallel region: out + j ldo = (x + j ldx) W_j^T + b_j, ldx 0 for one x shared by all. A mixture's chosen
 * experts at one decoding token (csrc/moe_decode.c): three regions a layer instead of five, the second thread
 * waiting at each end. W4A8 (with VNNI) and float32; returns 0 where the format has no such path: the caller runs
 * them one by one.
 */
int linear_gemv_m1_many(float *out, int64_t ldo, const float *x, int64_t ldx, int k, int64_t K, int64_t N, int fmt,
                        const void *const *w, const void *const *scale, const void *const *mins, int64_t G,
                        const float *const *bias, float *scratch, int num_threads) {
    const int halves = (fmt & (FMT_F16_SCALES | FMT_F32_MINS | FMT_SYM_MINS | FMT_ACT_BLOCKS)) / FMT_F16_SCALES;
    fmt &= ~(FMT_F16_SCALES | FMT_F32_MINS | FMT_SYM_MINS | FMT_ACT_BLOCKS);
    if (fmt == FMT_W4A8)
        return gemv_w4a8_m1_many(out, ldo, x, ldx, k, K, N, w, scale, mins, G, halves, bias, scratch, num_threads);
    if (fmt == FMT_F32) return dense_m1_many(out, ldo, x, ldx, k, K, N, w, bias, num_threads);
    return 0;
}
