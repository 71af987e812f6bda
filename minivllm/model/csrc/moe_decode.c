/*
 * A mixture-of-experts MLP for the decode stack (csrc/decode_stack.c): the same computation as model/moe.py's
 * SparseMoE, without a Python call per expert. At one decoding token the module path ran a dozen small ops and
 * two projections per chosen expert through Python (router, softmax, top-k, then k x (gate_up, act, down, scale,
 * add)): per-call cost that made a step of a mixture 1.6x its dense twin's. Here the router, the routing and each
 * active expert's GEMVs run back to back; tokens are grouped by expert as the module path groups them, so a step
 * of several decodes reads each active expert's weights once.
 */
#include <math.h>
#include <string.h>

#include "decode_stack.h"

/* The router as transformers computes it: softmax of the logits over all experts in float32, the k largest
 * (the lowest index first among equals), renormalised where the family says. */
static void route(const float *logits, int64_t E, int64_t k, int norm, int64_t *ids, float *weights) {
    float mx = logits[0];
    for (int64_t e = 1; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
    float total = 0.f;
    for (int64_t e = 0; e < E; e++) total += expf(logits[e] - mx);
    float picked = 0.f;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        ids[j] = best;
        weights[j] = expf(logits[best] - mx) / total;
        picked += weights[j];
    }
    if (norm)
        for (int64_t j = 0; j < k; j++) weights[j] /= picked;
}

/* The chosen experts' projections p[ids[j]] (j < k) at one token, in one parallel region where their format has a
 * path for it (csrc/gemv.c's linear_gemv_m1_many); returns 0 where not (the caller runs them one by one). */
static int project_experts(float *out, int64_t ldo, const float *x, int64_t ldx, const proj_t *p, const int64_t *ids,
                           int64_t k, const step_t *s) {
    const void *w[16], *scale[16], *mins[16];
    const float *bias[16];
    if (k > 16) return 0;
    const proj_t *p0 = p + ids[0];
    for (int64_t j = 0; j < k; j++) {
        const proj_t *q = p + ids[j];
        if (q->fmt != p0->fmt || q->K != p0->K || q->N != p0->N || q->G != p0->G) return 0;
        w[j] = q->w, scale[j] = q->scale, mins[j] = q->mins, bias[j] = q->bias;
    }
    return linear_gemv_m1_many(out, ldo, x, ldx, (int)k, p0->K, p0->N, (int)p0->fmt, w, scale, mins, p0->G, bias,
                               s->gemv_scratch, (int)s->num_threads);
}

/* One decoding token: its k experts' gate_up rows in one region, then their down rows in another (where the format
 * allows: project_experts), their outputs summed in expert order as the grouped path below sums them.
 * Returns 0 where the format has no such path. gu [k, 2I], act [k, I], ys [k, H]. */
static int moe_one_token(float *out, const float *x, const moe_t *e, const step_t *s, const int64_t *picked,
                         const float *weights, float *gu, float *act, float *ys) {
    const int64_t H = s->H, k = e->k, I = e->I;
    int64_t ids[16];
    float w[16];
    if (k > 16) return 0;
    for (int64_t j = 0; j < k; j++) { /* in expert order (insertion sort of at most 16) */
        int64_t i = j;
        for (; i > 0 && ids[i - 1] > picked[j]; i--) ids[i] = ids[i - 1], w[i] = w[i - 1];
        ids[i] = picked[j], w[i] = weights[j];
    }
    if (!project_experts(gu, 2 * I, x, 0, e->gate_up, ids, k, s)) return 0;
    gated_act(gu, act, I, k, I, s);
    bf16_input(act, k * I, s);
    if (!project_experts(ys, H, act, I, e->down, ids, k, s)) { /* (a down format unlike its gate_up's) */
        for (int64_t j = 0; j < k; j++) project_rows(ys + j * H, H, act + j * I, I, 1, &e->down[ids[j]], s);
    }
    memset(out, 0, (size_t)H * sizeof(float));
    for (int64_t j = 0; j < k; j++) {
        e->expert_tokens[ids[j]] += 1;
        const float *y = ys + j * H;
        for (int64_t c = 0; c < H; c++) out[c] += w[j] * y[c];
    }
    return 1;
}

/* Tokens grouped by expert: each active expert's GEMM over its tokens, scattered back weighted. */
static void moe_grouped(float *out, const float *x, const moe_t *e, const step_t *s, const int64_t *ids,
                        const float *weights, float *xs, float *gu, float *act, float *ys) {
    const int64_t M = s->M, H = s->H, E = e->E, k = e->k, I = e->I;
    int64_t *rows = s->moe_ids + M * k, *slots = rows + M * k;
    memset(out, 0, (size_t)(M * H) * sizeof(float));
    for (int64_t ex = 0; ex < E; ex++) {
        int64_t n = 0; /* this expert's (token, slot) pairs, in token order */
        for (int64_t t = 0; t < M; t++)
            for (int64_t j = 0; j < k; j++)
                if (ids[t * k + j] == ex) rows[n] = t, slots[n++] = t * k + j;
        if (!n) continue;
        e->expert_tokens[ex] += n;
        const float *in = x;
        if (n != M || M != 1) { /* gather its tokens (one decoding token reads x as it is) */
            for (int64_t i = 0; i < n; i++) memcpy(xs + i * H, x + rows[i] * H, (size_t)H * sizeof(float));
            in = xs;
        }
        project_rows(gu, 2 * I, in, H, n, &e->gate_up[ex], s);
        gated_act(gu, act, I, n, I, s);
        bf16_input(act, n * I, s);
        project_rows(ys, H, act, I, n, &e->down[ex], s);
        for (int64_t i = 0; i < n; i++) {
            const float w = weights[slots[i]], *y = ys + i * H;
            float *o = out + rows[i] * H;
            for (int64_t c = 0; c < H; c++) o[c] += w * y[c];
        }
    }
}

/*
 * out [M, H] = the experts' weighted sum (+ the gated shared expert) for x [M, H].
 * s->moe_work: max(M, k) (E + k + 2H + 3 Imax) floats, Imax the larger of the experts' and the shared expert's
 * intermediate sizes; s->moe_ids: 3 M k int64.
 */
void moe_f32(float *out, const float *x, const moe_t *e, const step_t *s) {
    const int64_t M = s->M, H = s->H, E = e->E, k = e->k, I = e->I;
    const int64_t Imax = e->shared_I > I ? e->shared_I : I;
    float *logits = s->moe_work, *weights = logits + M * E, *xs = weights + M * k, *ys = xs + M * H;
    float *gu = ys + M * H, *act = gu + M * 2 * Imax;
    int64_t *ids = s->moe_ids;

    project_rows(logits, E, x, H, M, &e->router, s);
    for (int64_t t = 0; t < M; t++) route(logits + t * E, E, k, (int)e->norm_topk, ids + t * k, weights + t * k);
    /* one token: its k experts' [k, H] outputs, [k, 2I] and [k, I] activations after its weights */
    float *ys1 = weights + k, *gu1 = ys1 + k * H;
    if (M != 1 || !moe_one_token(out, x, e, s, ids, weights, gu1, gu1 + k * 2 * I, ys1))
        moe_grouped(out, x, e, s, ids, weights, xs, gu, act, ys);
    if (e->shared_I) { /* Qwen2-MoE: + sigmoid(x . g) x the shared expert's MLP */
        const int64_t Is = e->shared_I;
        project_rows(gu, 2 * Is, x, H, M, &e->shared_gate_up, s);
        gated_act(gu, act, Is, M, Is, s);
        bf16_input(act, M * Is, s);
        project_rows(ys, H, act, Is, M, &e->shared_down, s);
        project_rows(logits, 1, x, H, M, &e->shared_gate, s);
        for (int64_t t = 0; t < M; t++) {
            const float g = 1.f / (1.f + expf(-logits[t]));
            for (int64_t c = 0; c < H; c++) out[t * H + c] += g * ys[t * H + c];
        }
    }
}
