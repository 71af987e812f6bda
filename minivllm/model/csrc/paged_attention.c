/*
 * Paged attention for CPU: every query token attends to its sequence's context, read straight
 * out of the KV block pool through the block table (no gathered copy of the context).
 *
 * One query token per sequence (decode). q and out are float32; the cache is float32, bfloat16 (widened
 * to float32 as it is read, so a bf16 model reads half the KV bytes) or int8 with one float16 scale per
 * (slot, kv head) (--kv-cache-dtype int8: a quarter of float32's bytes; the scale multiplies the dot
 * product of a key row and the weight of a value row, so a row is never dequantized element by element).
 * Layouts:
 *   q           [T, H, D], rows q_stride floats apart (q may be a view into the fused qkv output)
 *   out         [T, H, D] contiguous
 *   k/v cache   [num_blocks, block_size, KVH, D] contiguous
 *   k/v scale   [num_blocks, block_size, KVH] float16 (int8 caches only)
 *   block_tables[T, bt_stride] (int64, unit column stride): row t is token t's sequence
 * Token t sits at position positions[t]; it sees keys at positions max(0, pos - window + 1) .. pos
 * (window <= 0: no sliding window) and, with sinks > 0, the first `sinks` positions too (StreamingLLM's
 * attention sinks: --kv-eviction sink-window frees the blocks in between, which are never read).
 * softcap > 0 (Gemma 2) caps every scaled score as softcap * tanh(score / softcap) before the softmax.
 *
 * Work items are (token, range of kv heads) (see paged_attention_f32); the G = H / KVH query heads of a group
 * share each K/V row load. Scores go to a per-thread scratch row, then one softmax pass, then the weighted V sum:
 * three vectorisable loops instead of an online softmax with a rescale per key.
 *
 * Speed (measured, see BENCHMARKS.md): the work-item body is compiled once per common
 * (G, head_dim) pair so the G x head_dim/16 accumulators live in registers, which halved the time
 * against one generic body. Head dims that are a multiple of 16 use 16-lane GCC vector extensions
 * (AVX-512 where present, split into narrower registers elsewhere); anything else runs plain loops.
 */
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

/* Key j of an item (sinks first, then the window) → its position. */
INLINE int64_t key_pos(const item_t *it, int64_t j) {
    return j < it->sink_end ? j : it->start + (j - it->sink_end);
}

/* Any head_dim / group size: plain loops. */
static void item_scalar(const item_t *it, int G, int D) {
    const int64_t stride = it->stride, n = it->sink_end + (it->end - it->start);
    for (int64_t j = 0; j < n; j++) {
        const int64_t p = key_pos(it, j);
        const int64_t kr = slot_row(it, p) + (int64_t)it->g * D;
        const float ks = row_scale(it, it->k_scale, slot_of(it, p), it->fmt);
        for (int h = 0; h < G; h++) {
            float acc = 0.f;
            for (int d = 0; d < D; d++) acc += it->qg[h * D + d] * load_kv1(it->k_cache, kr + d, it->fmt);
            it->sc[h * stride + j] = acc * it->scale * ks;
        }
    }
    softmax_rows(it->sc, stride, G, n, it->softcap);
    for (int i = 0; i < G * D; i++) it->og[i] = 0.f;
    for (int64_t j = 0; j < n; j++) {
        const int64_t p = key_pos(it, j);
        const int64_t vr = slot_row(it, p) + (int64_t)it->g * D;
        const float vs = row_scale(it, it->v_scale, slot_of(it, p), it->fmt);
        for (int h = 0; h < G; h++) {
            const float w = it->sc[h * stride + j] * vs;
            for (int d = 0; d < D; d++) it->og[h * D + d] += w * load_kv1(it->v_cache, vr + d, it->fmt);
        }
    }
}

/* item_vec is always_inline (so constants propagate); this is its callable, non-specialised form. */
static void item_generic(const item_t *it, int G, int D) {
    if (it->fmt == KV_BF16)
        item_vec(it, G, D, KV_BF16);
    else if (it->fmt == KV_INT8)
        item_vec(it, G, D, KV_INT8);
    else
        item_vec(it, G, D, KV_F32);
}

/* One body per (G, D) and cache dtype. */
#define SPECIALISE(GG, DD)                                                                              \
    static void item_##GG##_##DD(const item_t *it, int G, int D) {                                      \
        (void)G, (void)D;                                                                               \
        if (it->fmt == KV_BF16)                                                                         \
            item_vec(it, GG, DD, KV_BF16);                                                              \
        else if (it->fmt == KV_INT8)                                                                    \
            item_vec(it, GG, DD, KV_INT8);                                                              \
        else                                                                                            \
            item_vec(it, GG, DD, KV_F32);                                                               \
    }
/* Group sizes of the supported families: Llama-3.x 1B (4), SmolLM2 (3), Qwen2.5-0.5B (7), TinyLlama /
 * Mistral (8 / 4), GPT-2 and MHA models (1); Qwen3-0.6B (2 at 128), Phi-4-mini (3 at 128), SmolLM3 (4 at 128),
 * OLMo 2 (1 at 128), Gemma 2 2B (2 at 256), Gemma 3 1B (4 at 256). */
SPECIALISE(1, 64) SPECIALISE(2, 64) SPECIALISE(3, 64) SPECIALISE(4, 64) SPECIALISE(5, 64) SPECIALISE(6, 64)
SPECIALISE(7, 64) SPECIALISE(8, 64) SPECIALISE(1, 128) SPECIALISE(2, 128) SPECIALISE(4, 128)
SPECIALISE(5, 128) SPECIALISE(6, 128) SPECIALISE(7, 128) SPECIALISE(8, 128) SPECIALISE(3, 128)
SPECIALISE(1, 256) SPECIALISE(2, 256) SPECIALISE(4, 256)

typedef void (*item_fn)(const item_t *, int, int);

static item_fn pick(int G, int D) {
    switch (D * 100 + G) {
    case 6401: return item_1_64;
    case 6402: return item_2_64;
    case 6403: return item_3_64;
    case 6404: return item_4_64;
    case 6405: return item_5_64;
    case 6406: return item_6_64;
    case 6407: return item_7_64;
    case 6408: return item_8_64;
    case 12801: return item_1_128;
    case 12802: return item_2_128;
    case 12804: return item_4_128;
    case 12805: return item_5_128;
    case 12806: return item_6_128;
    case 12807: return item_7_128;
    case 12808: return item_8_128;
    case 12803: return item_3_128;
    case 25601: return item_1_256;
    case 25602: return item_2_256;
    case 25604: return item_4_256;
    }
    if (D % 16 == 0 && D / 16 <= MAX_CHUNKS && G <= MAX_G) return item_generic;
    return item_scalar;
}

/* scratch: num_threads * round_up(num_heads, 16) * round_up(max_ctx, 16) floats, owned by the caller (no allocation per call).
 * num_threads is passed in, not read from this thread's OpenMP settings, so the engine's thread
 * count holds whichever thread calls.
 * Work items are (token, range of kv heads): each token's kv heads are split into the fewest ranges that still
 * give every thread about four items (a batch of decodes: one row item per token, streaming whole slots; a
 * single sequence: one item per kv head, the register-resident body). */
void paged_attention_f32(float *out, const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                        int kv_fmt, const _Float16 *k_scale, const _Float16 *v_scale, const int64_t *block_tables, int64_t bt_stride, const int64_t *positions,
                        int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                        float softcap, int64_t window, int64_t sinks, int64_t max_ctx, float *scratch,
                        int num_threads) {
    const int G = num_heads / num_kv_heads, D = head_dim;
    const item_fn fn = pick(G, D);
    const int64_t stride = (max_ctx + 15) / 16 * 16;
    /* Items per token for about four per thread, as ranges of equal numbers of kv heads; one head per item runs
     * the register-resident body, which beats a row item of two heads (mostly empty lanes) on cached context. */
    const int64_t want = num_tokens > 0 ? (4 * (int64_t)num_threads + num_tokens - 1) / num_tokens : 1;
    const int per_item = fn == item_scalar || want >= num_kv_heads ? 1 : num_kv_heads / (int)want;
    const int parts = (num_kv_heads + per_item - 1) / per_item;

#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t t = 0; t < num_tokens; t++) {
        for (int part = 0; part < parts; part++) {
            const int g = (int)((int64_t)part * num_kv_heads / parts), g_end = (int)((int64_t)(part + 1) * num_kv_heads / parts);
            const int64_t pos = positions[t];
            const int64_t start = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
            item_t it = {
                .sc = scratch + (size_t)omp_get_thread_num() * ((num_heads + 15) / 16 * 16) * stride,
                .stride = stride,
                .qg = q + t * q_stride + (int64_t)g * G * D,
                .og = out + (t * num_heads + (int64_t)g * G) * D,
                .k_cache = k_cache,
                .v_cache = v_cache,
                .k_scale = k_scale,
                .v_scale = v_scale,
                .table = block_tables + t * bt_stride,
                .start = start,
                .sink_end = sinks < start ? sinks : start,
                .end = pos + 1,
                .bs = block_size,
                .row = (int64_t)num_kv_heads * D,
                .nkv = num_kv_heads,
                .g = g,
                .g_end = g_end,
                .scale = scale,
                .softcap = softcap,
                .fmt = kv_fmt,
            };
            fn(&it, G, D);
        }
    }
}
