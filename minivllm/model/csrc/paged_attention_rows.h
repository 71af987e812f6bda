/* Paged attention's row items (included by csrc/paged_attention_items.h, whose bodies are specialised per (G, D, format)). */
#pragma once
#include "paged_attention.h"

/* Row items: kv heads [g, g_end) of one token at once, slot by slot. A slot holds all kv heads' rows side by side,
 * so this scan streams (g_end - g) * D contiguous values per slot, where a one-head item reads D values every
 * kv_heads * D (a quarter of each 4 KiB page for GPT-2's 12 heads): once a step's KV no longer fits in cache
 * (50 sequences of GPT-2 x 50 tokens is 15 MB per layer) the strided scan ran at ~12 GB/s. Scores are kept
 * position-major, sc[j][head] (heads padded to 16 lanes), so each slot's dot products of all heads reduce
 * together (hsum16x16) and the softmax and the V pass run across heads in vectors. The V pass sums in registers,
 * a few kv heads at a time (values_rows). The next block's rows are prefetched a slot row at a time, since blocks
 * sit at random places in the pool.
 *
 * Measured (Zen 5, SmolLM2's 9 heads over 3 kv heads, 64 sequences x 224 positions x 30 layers): with the context
 * in cache 13.2-16.0 ms -> 8.6-10.1 ms a step's attention; from DRAM (random blocks of a 2 GiB pool) unchanged at
 * 27-32 ms, ~24 GB/s against a 40 GB/s probe, bound by the misses (no prefetch: 43-47 ms; the prefetch 8-48 slots
 * ahead, or into L2 only, or the pool in 2 MiB pages: all the same); a bfloat16 pool 20-24 -> 19 ms; GPT-2's
 * 50 sequences at 35 positions 5.2-6.9 -> 4.5-5.0 ms in the engine's step. */
INLINE void prefetch_row(const void *cache, const item_t *it, int64_t slot, int D, int FMT) {
    const int esz = FMT == KV_F32 ? 4 : FMT == KV_BF16 ? 2 : 1;
    const char *r = (const char *)cache + (slot * it->row + (int64_t)it->g * D) * esz;
    const int bytes = (it->g_end - it->g) * D * esz;
    for (int c = 0; c < bytes; c += 64) __builtin_prefetch(r + c);
}

/* Sixteen vectors of partial sums -> one vector of their totals (lane i: the sum of a[i]'s lanes): a transpose-
 * and-add tree of 15 two-source shuffles, where one horizontal sum per vector costs ~8 dependent operations. */
INLINE v16 hsum16x16(const v16 *a) {
    v16 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* Scores of positions [lo_all, hi_all) into rows off + p - lo_all of sc [n][NP]. Each kv head's K row is loaded once
 * for its G query heads; the heads' products fill a[] in order and every 16 reduce together (hsum16x16), the scale
 * applied to the 16 sums at once. (The loop over 16 lanes with each head's K reloaded and its scale applied per lane
 * ran ~280 cycles a slot of SmolLM2's 9 heads from cache.) */
INLINE void scores_rows(const item_t *it, int64_t lo_all, int64_t hi_all, int64_t off, int NP, int G, int D, int FMT) {
    const int C = D / 16, KH = it->g_end - it->g;
    const int64_t bs = it->bs;
    const float *q = it->qg;
    for (int64_t b = lo_all / bs; b * bs < hi_all; b++) {
        const int64_t lo = b * bs > lo_all ? b * bs : lo_all, hi = (b + 1) * bs < hi_all ? (b + 1) * bs : hi_all;
        const int ahead = (b + 1) * bs < hi_all;
        for (int64_t p = lo; p < hi; p++) {
            const int64_t slot = it->table[b] * bs + (p - b * bs);
            if (ahead) prefetch_row(it->k_cache, it, it->table[b + 1] * bs + (p - b * bs), D, FMT);
            float *row = it->sc + (off + p - lo_all) * NP;
            const int64_t base = slot * it->row + (int64_t)it->g * D;
            v16 a[16];
            int fill = 0, hb = 0;
            for (int k = 0; k < KH; k++) {
                v16 kv[MAX_CHUNKS];
                for (int c = 0; c < C; c++) kv[c] = load_kv16(it->k_cache, base + (int64_t)k * D + c * 16, FMT);
                const float ks = FMT == KV_INT8 ? (float)it->k_scale[slot * it->nkv + it->g + k] : 1.f;
                for (int h = 0; h < G; h++) {
                    const float *qh = q + (int64_t)(k * G + h) * D;
                    v16 s = load16(qh) * kv[0];
                    for (int c = 1; c < C; c++) s += load16(qh + c * 16) * kv[c];
                    a[fill++] = FMT == KV_INT8 ? s * ks : s;
                    if (fill == 16) {
                        store16(row + hb, hsum16x16(a) * it->scale);
                        hb += 16, fill = 0;
                    }
                }
            }
            if (fill) {
                for (int i = fill; i < 16; i++) a[i] = (v16){0};
                store16(row + hb, hsum16x16(a) * it->scale);
            }
        }
    }
}

/* The V pass keeps its sums in registers: ACC_REGS vectors, as KB kv heads x G query heads x CC chunks of D. */
#define ACC_REGS 24

/* acc[(kk * G + h) * CC + c] += sc[off + p - lo_all][(k0 + kk) * G + h] x chunk c0 + c of kv head k0 + kk's V row,
 * over positions [lo_all, hi_all); with `prefetch`, the next block's rows (every kv head of the item) are asked for. */
INLINE void values_sub(const item_t *it, v16 *acc, int64_t lo_all, int64_t hi_all, int64_t off, int NP, int k0, int KB,
                       int c0, int CC, int G, int D, int FMT, int prefetch) {
    const int C = D / 16, KH = it->g_end - it->g;
    const int64_t bs = it->bs;
    for (int64_t b = lo_all / bs; b * bs < hi_all; b++) {
        const int64_t lo = b * bs > lo_all ? b * bs : lo_all, hi = (b + 1) * bs < hi_all ? (b + 1) * bs : hi_all;
        const int ahead = prefetch && (b + 1) * bs < hi_all;
        for (int64_t p = lo; p < hi; p++) {
            const int64_t slot = it->table[b] * bs + (p - b * bs);
            if (ahead) prefetch_row(it->v_cache, it, it->table[b + 1] * bs + (p - b * bs), D, FMT);
            const float *w = it->sc + (off + p - lo_all) * NP;
#pragma GCC unroll 24
            for (int kk = 0; kk < KB; kk++) {
                const int k = k0 + kk;
                if (k >= KH) break;
                const int64_t vr = slot * it->row + (int64_t)(it->g + k) * D + c0 * 16;
                const float vs = FMT == KV_INT8 ? (float)it->v_scale[slot * it->nkv + it->g + k] : 1.f;
#pragma GCC unroll 16
                for (int c = 0; c < CC; c++) {
                    if (c0 + c >= C) break;
                    const v16 vv = load_kv16(it->v_cache, vr + c * 16, FMT);
#pragma GCC unroll 32
                    for (int h = 0; h < G; h++) acc[(kk * G + h) * CC + c] += (w[k * G + h] * vs) * vv;
                }
            }
        }
    }
}

/* og[k * G + h] = sum over the item's positions of sc[.][k * G + h] x V row of kv head g + k, ACC_REGS sums at a
 * time in registers (the sums lived in og and each slot loaded and stored every one of them). The item's V rows
 * stream in the first sub-pass (which prefetches them); later sub-passes read them back from L2. */
INLINE void values_rows(const item_t *it, int64_t ns, int NP, int G, int D, int FMT) {
    const int C = D / 16, KH = it->g_end - it->g;
    const int CC = G * C <= ACC_REGS ? C : (ACC_REGS / G > 0 ? ACC_REGS / G : 1);
    const int KB = G * C <= ACC_REGS ? ACC_REGS / (G * C) : 1;
    for (int k0 = 0; k0 < KH; k0 += KB) {
        for (int c0 = 0; c0 < C; c0 += CC) {
            v16 acc[ACC_REGS + MAX_G];
#pragma GCC unroll 56
            for (int i = 0; i < KB * G * CC; i++) acc[i] = (v16){0};
            const int first = k0 == 0 && c0 == 0;
            if (ns) values_sub(it, acc, 0, ns, 0, NP, k0, KB, c0, CC, G, D, FMT, first);
            values_sub(it, acc, it->start, it->end, ns, NP, k0, KB, c0, CC, G, D, FMT, first);
            for (int kk = 0; kk < KB && k0 + kk < KH; kk++)
                for (int h = 0; h < G; h++)
                    for (int c = 0; c < CC && c0 + c < C; c++)
                        store16(it->og + (int64_t)((k0 + kk) * G + h) * D + (c0 + c) * 16, acc[(kk * G + h) * CC + c]);
        }
    }
}

/* Softmax down each head's column of sc [n][NP], vectorised across heads. */
static void softmax_columns(float *sc, int64_t n, int NP, float softcap) {
    if (softcap > 0.f) {
        const float inv_cap = 1.f / softcap;
        for (int64_t i = 0; i < n * NP; i++) sc[i] = softcap * tanhf(sc[i] * inv_cap);
    }
    for (int hb = 0; hb < NP; hb += 16) {
        float m[16], sum[16];
        memcpy(m, sc + hb, sizeof m);
        for (int64_t j = 1; j < n; j++) {
            const float *r = sc + j * NP + hb;
#pragma omp simd
            for (int i = 0; i < 16; i++) m[i] = r[i] > m[i] ? r[i] : m[i];
        }
        for (int i = 0; i < 16; i++) sum[i] = 0.f;
        for (int64_t j = 0; j < n; j++) {
            float *r = sc + j * NP + hb;
#pragma omp simd
            for (int i = 0; i < 16; i++) {
                r[i] = expf(r[i] - m[i]);
                sum[i] += r[i];
            }
        }
        for (int i = 0; i < 16; i++) sum[i] = 1.f / sum[i];
        for (int64_t j = 0; j < n; j++) {
            float *r = sc + j * NP + hb;
#pragma omp simd
            for (int i = 0; i < 16; i++) r[i] *= sum[i];
        }
    }
}

INLINE void item_rows(const item_t *it, int G, int D, int FMT) {
    const int64_t ns = it->sink_end, nw = it->end - it->start;
    const int heads = (it->g_end - it->g) * G, NP = (heads + 15) / 16 * 16;
    if (ns) scores_rows(it, 0, ns, 0, NP, G, D, FMT);
    scores_rows(it, it->start, it->end, ns, NP, G, D, FMT);
    softmax_columns(it->sc, ns + nw, NP, it->softcap);
    values_rows(it, ns, NP, G, D, FMT);
}
