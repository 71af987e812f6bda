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

/*
 * out [M, H] = the experts' weighted sum (+ the gated shared expert) for x [M, H].
 * s->moe_work: M (E + k + 2H + 3 Imax) floats, Imax the larger of the experts' and the shared expert's
 * intermediate sizes; s->moe_ids: 3 M k int64.
 */
void moe_f32(float *out, const float *x, const moe_t *e, const step_t *s) {
    const int64_t M = s->M, H = s->H, E = e->E, k = e->k, I = e->I;
    const int64_t Imax = e->shared_I > I ? e->shared_I : I;
    float *logits = s->moe_work, *weights = logits + M * E, *xs = weights + M * k, *ys = xs + M * H;
    float *gu = ys + M * H, *act = gu + M * 2 * Imax;
    int64_t *ids = s->moe_ids, *rows = ids + M * k, *slots = rows + M * k;

    project_rows(logits, E, x, H, M, &e->router, s);
    for (int64_t t = 0; t < M; t++) route(logits + t * E, E, k, (int)e->norm_topk, ids + t * k, weights + t * k);
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
        gated_act(gu, act, n, I, s);
        project_rows(ys, H, act, I, n, &e->down[ex], s);
        for (int64_t i = 0; i < n; i++) {
            const float w = weights[slots[i]], *y = ys + i * H;
            float *o = out + rows[i] * H;
            for (int64_t c = 0; c < H; c++) o[c] += w * y[c];
        }
    }
    if (e->shared_I) { /* Qwen2-MoE: + sigmoid(x . g) x the shared expert's MLP */
        const int64_t Is = e->shared_I;
        project_rows(gu, 2 * Is, x, H, M, &e->shared_gate_up, s);
        gated_act(gu, act, M, Is, s);
        project_rows(ys, H, act, Is, M, &e->shared_down, s);
        project_rows(logits, 1, x, H, M, &e->shared_gate, s);
        for (int64_t t = 0; t < M; t++) {
            const float g = 1.f / (1.f + expf(-logits[t]));
            for (int64_t c = 0; c < H; c++) out[t * H + c] += g * ys[t * H + c];
        }
    }
}
