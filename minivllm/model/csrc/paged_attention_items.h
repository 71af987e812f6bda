/* Paged attention's work-item bodies, specialised per (G, head_dim) and cache format by the two translation units
 * that include this (csrc/paged_attention.c: head_dim 64; csrc/paged_attention_wide.c: 128 and 256): 57 fully
 * inlined bodies took 24 s of -O3 in one file, the longest wait of a first build; in two, they compile on two cores. */
#pragma once
#include "paged_attention.h"

/* Slot (block * block_size + offset) of position p. */
INLINE int64_t slot_of(const item_t *it, int64_t p) { return it->table[p / it->bs] * it->bs + p % it->bs; }

/* Element index of the start of position p's slot (all kv heads) in a cache. */
INLINE int64_t slot_row(const item_t *it, int64_t p) { return slot_of(it, p) * it->row; }

/* The dequantization scale of this item's kv head at a slot (1 for float caches). */
INLINE float row_scale(const item_t *it, const _Float16 *scale, int64_t slot, int fmt) {
    return fmt == KV_INT8 ? (float)scale[slot * it->nkv + it->g] : 1.f;
}

/* Blocks sit at random places in the pool, so the hardware prefetcher cannot guess the next one:
 * ask for block b's rows of this kv head while the current block is being worked on (measured
 * 22% faster when the KV cache streams from DRAM). */
INLINE void prefetch_block(const void *cache, const item_t *it, int64_t b, int D) {
    if (b * it->bs >= it->end) return;
    const int esz = it->fmt == KV_F32 ? 4 : it->fmt == KV_BF16 ? 2 : 1;
    const char *nb = (const char *)cache + (it->table[b] * it->bs * it->row + (int64_t)it->g * D) * esz;
    for (int r = 0; r < it->bs; r++)
        for (int c = 0; c < D * esz; c += 64) __builtin_prefetch(nb + r * it->row * esz + c);
}

static void softmax_rows(float *sc, int64_t stride, int G, int64_t n, float softcap) {
    for (int h = 0; h < G; h++) {
        float *s = sc + h * stride;
        if (softcap > 0.f) {
            const float inv_cap = 1.f / softcap;
            for (int64_t j = 0; j < n; j++) s[j] = softcap * tanhf(s[j] * inv_cap);
        }
        float m = s[0]; /* not -INFINITY: -ffast-math assumes no infinities */
        for (int64_t j = 1; j < n; j++) m = s[j] > m ? s[j] : m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; j++) {
            s[j] = expf(s[j] - m);
            sum += s[j];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) s[j] *= inv;
    }
}

/* Scores of positions [lo, hi) (block by block, so no division per key) into sc[h][off + p - lo]. */
INLINE void scores_range(const item_t *it, const v16 *qv, int64_t lo_all, int64_t hi_all, int64_t off, int G, int D,
                         int FMT) {
    const int C = D / 16;
    const int64_t bs = it->bs, stride = it->stride;
    for (int64_t b = lo_all / bs; b * bs < hi_all; b++) {
        const int64_t lo = b * bs > lo_all ? b * bs : lo_all, hi = (b + 1) * bs < hi_all ? (b + 1) * bs : hi_all;
        const int64_t base = it->table[b] * bs * it->row + (int64_t)it->g * D;
        if ((b + 1) * bs < hi_all) prefetch_block(it->k_cache, it, b + 1, D);
        for (int64_t p = lo; p < hi; p++) {
            const int64_t kr = base + (p - b * bs) * it->row;
            v16 acc[MAX_G];
            for (int h = 0; h < G; h++) acc[h] = (v16){0};
            for (int c = 0; c < C; c++) {
                const v16 kv = load_kv16(it->k_cache, kr + c * 16, FMT);
                for (int h = 0; h < G; h++) acc[h] += qv[h * C + c] * kv;
            }
            const float ks = row_scale(it, it->k_scale, it->table[b] * bs + (p - b * bs), FMT);
            for (int h = 0; h < G; h++) it->sc[h * stride + off + (p - lo_all)] = hsum16(acc[h]) * ks;
        }
    }
}

/* out[h] += sum over positions [lo, hi) of weight sc[h][off + p - lo] x V row p. */
INLINE void values_range(const item_t *it, v16 *out, int64_t lo_all, int64_t hi_all, int64_t off, int G, int D,
                         int FMT) {
    const int C = D / 16;
    const int64_t bs = it->bs, stride = it->stride;
    for (int64_t b = lo_all / bs; b * bs < hi_all; b++) {
        const int64_t lo = b * bs > lo_all ? b * bs : lo_all, hi = (b + 1) * bs < hi_all ? (b + 1) * bs : hi_all;
        const int64_t base = it->table[b] * bs * it->row + (int64_t)it->g * D;
        if ((b + 1) * bs < hi_all) prefetch_block(it->v_cache, it, b + 1, D);
        for (int64_t p = lo; p < hi; p++) {
            const int64_t vr = base + (p - b * bs) * it->row;
            const float vs = row_scale(it, it->v_scale, it->table[b] * bs + (p - b * bs), FMT);
            float w[MAX_G];
            for (int h = 0; h < G; h++) w[h] = it->sc[h * stride + off + (p - lo_all)] * vs;
            for (int c = 0; c < C; c++) {
                const v16 vv = load_kv16(it->v_cache, vr + c * 16, FMT);
                for (int h = 0; h < G; h++) out[h * C + c] += w[h] * vv;
            }
        }
    }
}

#include "paged_attention_rows.h"

/* Vector path; G, D and FMT (the cache's format) are compile-time constants in every specialised caller.
 * Keys: the attention sinks [0, sink_end), then the window [start, end); scores in that order. */
INLINE void item_vec(const item_t *it, int G, int D, int FMT) {
    if (it->g_end > it->g + 1) {
        item_rows(it, G, D, FMT);
        return;
    }
    const int C = D / 16;
    const int64_t ns = it->sink_end, nw = it->end - it->start;
    v16 qv[MAX_G * MAX_CHUNKS];
    for (int h = 0; h < G; h++)
        for (int c = 0; c < C; c++) qv[h * C + c] = load16(it->qg + h * D + c * 16) * it->scale;
    /* 1. scores */
    if (ns) scores_range(it, qv, 0, ns, 0, G, D, FMT);
    scores_range(it, qv, it->start, it->end, ns, G, D, FMT);
    /* 2. softmax */
    softmax_rows(it->sc, it->stride, G, ns + nw, it->softcap);
    /* 3. weighted sum of V rows */
    v16 out[MAX_G * MAX_CHUNKS];
    for (int i = 0; i < G * C; i++) out[i] = (v16){0};
    if (ns) values_range(it, out, 0, ns, 0, G, D, FMT);
    values_range(it, out, it->start, it->end, ns, G, D, FMT);
    for (int h = 0; h < G; h++)
        for (int c = 0; c < C; c++) store16(it->og + h * D + c * 16, out[h * C + c]);
}

/* One body per (G, D) and cache dtype: G, D and the format are constants in each, so its accumulators live in
 * registers. */
#define SPECIALISE(GG, DD)                                                                              \
    void pa_item_##GG##_##DD(const item_t *it, int G, int D) {                                          \
        (void)G, (void)D;                                                                               \
        if (it->fmt == KV_BF16)                                                                         \
            item_vec(it, GG, DD, KV_BF16);                                                              \
        else if (it->fmt == KV_INT8)                                                                    \
            item_vec(it, GG, DD, KV_INT8);                                                              \
        else                                                                                            \
            item_vec(it, GG, DD, KV_F32);                                                               \
    }
#define DECLARE(GG, DD) void pa_item_##GG##_##DD(const item_t *it, int G, int D);
DECLARE(1, 64) DECLARE(2, 64) DECLARE(3, 64) DECLARE(4, 64) DECLARE(5, 64) DECLARE(6, 64) DECLARE(7, 64) DECLARE(8, 64)
DECLARE(1, 128) DECLARE(2, 128) DECLARE(3, 128) DECLARE(4, 128) DECLARE(5, 128) DECLARE(6, 128) DECLARE(7, 128) DECLARE(8, 128)
DECLARE(1, 256) DECLARE(2, 256) DECLARE(4, 256)
#undef DECLARE
