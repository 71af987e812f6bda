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
#include "paged_attention_items.h"

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

/* Group sizes of the supported families: Llama-3.x 1B (4), SmolLM2 (3), Qwen2.5-0.5B (7), TinyLlama /
 * Mistral (8 / 4), GPT-2 and MHA models (1); Qwen3-0.6B (2 at 128), Phi-4-mini (3 at 128), SmolLM3 (4 at 128),
 * OLMo 2 (1 at 128), Gemma 2 2B (2 at 256), Gemma 3 1B (4 at 256). */
SPECIALISE(1, 64) SPECIALISE(2, 64) SPECIALISE(3, 64) SPECIALISE(4, 64)
SPECIALISE(5, 64) SPECIALISE(6, 64) SPECIALISE(7, 64) SPECIALISE(8, 64)
/* (head_dim 128 and 256: csrc/paged_attention_wide.c) */

typedef void (*item_fn)(const item_t *, int, int);

static item_fn pick(int G, int D) {
    switch (D * 100 + G) {
    case 6401: return pa_item_1_64;
    case 6402: return pa_item_2_64;
    case 6403: return pa_item_3_64;
    case 6404: return pa_item_4_64;
    case 6405: return pa_item_5_64;
    case 6406: return pa_item_6_64;
    case 6407: return pa_item_7_64;
    case 6408: return pa_item_8_64;
    case 12801: return pa_item_1_128;
    case 12802: return pa_item_2_128;
    case 12804: return pa_item_4_128;
    case 12805: return pa_item_5_128;
    case 12806: return pa_item_6_128;
    case 12807: return pa_item_7_128;
    case 12808: return pa_item_8_128;
    case 12803: return pa_item_3_128;
    case 25601: return pa_item_1_256;
    case 25602: return pa_item_2_256;
    case 25604: return pa_item_4_256;
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
void paged_attention_f32_ld(float *out, int64_t out_stride, const float *q, int64_t q_stride, const void *k_cache,
                           const void *v_cache, int kv_fmt, const _Float16 *k_scale, const _Float16 *v_scale,
                           const int64_t *block_tables, int64_t bt_stride, const int64_t *positions,
                           int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim, int block_size,
                           float scale, float softcap, int64_t window, int64_t sinks, int64_t max_ctx, float *scratch,
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
                .og = out + t * out_stride + (int64_t)g * G * D,
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

/* out [num_tokens, num_heads * head_dim] contiguous; paged_attention_f32_ld writes rows out_stride floats apart
 * (csrc/decode_stack.c: where the o projection reads them in place, gemm_f32_x_ld(num_heads * head_dim)). */
void paged_attention_f32(float *out, const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                         int kv_fmt, const _Float16 *k_scale, const _Float16 *v_scale, const int64_t *block_tables,
                         int64_t bt_stride, const int64_t *positions, int64_t num_tokens, int num_heads,
                         int num_kv_heads, int head_dim, int block_size, float scale, float softcap, int64_t window,
                         int64_t sinks, int64_t max_ctx, float *scratch, int num_threads) {
    paged_attention_f32_ld(out, (int64_t)num_heads * head_dim, q, q_stride, k_cache, v_cache, kv_fmt, k_scale, v_scale,
                           block_tables, bt_stride, positions, num_tokens, num_heads, num_kv_heads, head_dim,
                           block_size, scale, softcap, window, sinks, max_ctx, scratch, num_threads);
}
