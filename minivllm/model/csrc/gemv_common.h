/*
 * What csrc/gemv.c (float, int8 and W8A8 rows; the formats' dispatch) and csrc/gemv_int4.c (int4 weight-only rows)
 * share: the vector types and loads, the layer a row kernel reads, the format codes, and the ISAs' row kernels
 * (csrc/gemv_avx2.h, csrc/gemv_avx512.h and the dot-product headers; each unit inlines the ones it calls).
 */
#ifndef MINIVLLM_GEMV_COMMON_H
#define MINIVLLM_GEMV_COMMON_H

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
    int64_t M;        /* the call's rows of x (int4's few-token rows: csrc/gemv_int4_int16dot.h) */
} Layer;

/* A call of at most this many rows of x is a handful (model/kernel_plan.py's second shape class: a batch-1
 * speculative verification, a small batch), where int4's rows take a float32 x as int16 as at one token; more rows
 * (a prefill) keep the float rows, exact. */
#define INT4_FEW_TOKENS 6

/* csrc/gemv.c: float rows of at most this many weights go one by one at a few tokens (set_gemv_few_rows_k) */
extern int64_t gemv_few_rows_k;

enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_INT8 = 2, FMT_INT4 = 3, FMT_W8A8 = 4, FMT_W4A8 = 5, FMT_Q8 = 6, FMT_Q8A8 = 7,
       FMT_Q6K = 8, FMT_Q4K = 9,
       FMT_F16_SCALES = 16, FMT_F32_MINS = 32, FMT_SYM_MINS = 64, FMT_ACT_BLOCKS = 128 };

#include "gemv_m1.h"
#include "gemv_bf16dot.h"

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

/* csrc/gemv_int4.c: y = x W^T + bias for M (<= MAX_M) rows of x against int4 weights (fmt FMT_INT4, L as the format
 * says; L->Kv is set there) */
void gemv_int4(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t N, const Layer *L, float *scratch,
               int num_threads);

#endif
