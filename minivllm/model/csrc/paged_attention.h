/* Paged attention (csrc/paged_attention.c): vector types, loads from the three cache formats and the work
 * item, shared with the row-item bodies (paged_attention_rows.h). */
#pragma once
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int8_t v16c __attribute__((vector_size(16)));
#define MAX_G 32
#define MAX_CHUNKS 16 /* head_dim <= 256 on the vector path */
#define INLINE static inline __attribute__((always_inline))

INLINE v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

INLINE float hsum16(v16 v) {
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[1]) + (b[2] + b[3]);
}

/* Everything one work item needs. */
typedef struct {
    float *sc;            /* scratch scores [G][stride] */
    int64_t stride;
    const float *qg;      /* G query heads, [G][D] */
    float *og;            /* G output heads */
    const void *k_cache, *v_cache; /* float32, bfloat16 bits or int8 (fmt) */
    const _Float16 *k_scale, *v_scale; /* int8: one per (slot, kv head) */
    const int64_t *table; /* this sequence's block table */
    int64_t sink_end;     /* attention sinks: key positions [0, sink_end), before the window */
    int64_t start, end;   /* key positions [start, end) */
    int bs;
    int64_t row;          /* elements per slot: KVH * D */
    int nkv;
    int g;                /* kv head (the first of [g, g_end)) */
    int g_end;            /* > g + 1: a row item (item_rows) over kv heads [g, g_end) */
    float scale;
    float softcap;        /* <= 0: none */
    int fmt;              /* KV_F32, KV_BF16, KV_INT8 */
} item_t;

enum { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2 };

/* 16 cache values from element index i: float32, bfloat16 widened (its bits are a float's upper half), or
 * int8 (unscaled: the caller applies the row's scale). */
INLINE v16 load_kv16(const void *cache, int64_t i, int fmt) {
    if (fmt == KV_F32) return load16((const float *)cache + i);
    if (fmt == KV_INT8) {
        /* GCC builds an int8 -> float vector conversion lane by lane (vpinsrd: the kernel ran 2.7x the bfloat16
         * one's time), so the sign extension is spelled out where the instruction set has it. */
        const int8_t *p = (const int8_t *)cache + i;
        v16 f;
#if defined(__AVX512F__)
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
        memcpy(&f, &w, sizeof f);
#elif defined(__AVX2__)
        const __m128i c = _mm_loadu_si128((const __m128i *)p);
        const __m256 w[2] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)),
                             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)))};
        memcpy(&f, w, sizeof f);
#else
        v16c c;
        memcpy(&c, p, sizeof c);
        f = __builtin_convertvector(c, v16);
#endif
        return f;
    }
    v16h h;
    memcpy(&h, (const uint16_t *)cache + i, sizeof h);
    v16u u = __builtin_convertvector(h, v16u) << 16;
    v16 f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE float load_kv1(const void *cache, int64_t i, int fmt) {
    if (fmt == KV_F32) return ((const float *)cache)[i];
    if (fmt == KV_INT8) return (float)((const int8_t *)cache)[i];
    uint32_t u = (uint32_t)((const uint16_t *)cache)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
