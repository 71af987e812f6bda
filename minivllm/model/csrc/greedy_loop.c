/*
 * A draft model's greedy proposal round in one call (model/greedy_loop.py, spec_decode/draft_proposer.py).
 *
 * A round is a catch-up forward (the one or few tokens the draft has not seen, one decode row each) whose last
 * rows give each sequence's first proposal, then k - 1 one-row-per-sequence forwards, each fed the argmax of the
 * last. The draft's layers already run as one native call (csrc/decode_stack.c: 0.13 ms for the shipped draft),
 * but from Python every forward also paid input packing, attention metadata, the LM head's module call and the
 * argmax (~1 ms a forward measured): a round of the shipped draft cost as much as half a target step, so the
 * adaptive rule proposed one token where the draft's acceptance would pay for four. Here embedding lookup,
 * slots, the stack, the head's GEMV and the argmax of every forward run back to back.
 *
 * Sequences are ordered by proposal count, longest first, so the sequences still proposing at forward i are a
 * prefix of the rows (their block tables too). Only greedy rows come here: the argmax of the head's output,
 * ties to the lowest id as torch.argmax does; a family's logit scaling and soft-capping keep the order.
 */
#include <stdint.h>
#include <string.h>

#include "decode_stack.h"

void decode_stack_f32(const layer_t *layers, int64_t n_layers, const float *final_norm, const step_t *s, float *h,
                      float *residual);

typedef struct {
    const void *embed;   /* [V, H] token embeddings */
    int64_t embed_bf16;  /* 1: bfloat16, 0: float32 */
    proj_t head;         /* [V, H] the LM head, any csrc/gemv.c format */
    float *logits;       /* [S, V] work */
    float *sampled;      /* [S, H] work: the catch-up's last rows */
    int64_t *slots;      /* [max(rows0, S)] work */
    int64_t *positions;  /* [S] work */
    int64_t *tokens;     /* [S] work */
} greedy_head_t;

static void embed_rows(float *h, const int64_t *tokens, int64_t M, int64_t H, const greedy_head_t *g) {
    for (int64_t r = 0; r < M; r++) {
        float *dst = h + r * H;
        if (g->embed_bf16) {
            const uint16_t *src = (const uint16_t *)g->embed + tokens[r] * H;
            for (int64_t j = 0; j < H; j++) {
                const uint32_t u = (uint32_t)src[j] << 16;
                memcpy(dst + j, &u, sizeof u);
            }
        } else {
            memcpy(dst, (const float *)g->embed + tokens[r] * H, (size_t)H * sizeof(float));
        }
    }
}

/* One forward of M decode rows: embeddings of tokens at positions, reading block tables [M, stride]. */
static void forward(const layer_t *layers, int64_t n_layers, const float *final_norm, step_t *s,
                    const greedy_head_t *g, int64_t M, const int64_t *tokens, const int64_t *positions,
                    const int64_t *tables, int64_t stride, float *h, float *residual) {
    const int64_t bs = s->block_size;
    int64_t max_pos = 0;
    for (int64_t r = 0; r < M; r++) {
        const int64_t p = positions[r];
        g->slots[r] = tables[r * stride + p / bs] * bs + p % bs;
        if (p > max_pos) max_pos = p;
    }
    embed_rows(h, tokens, M, s->H, g);
    s->M = M;
    s->positions = positions;
    s->slot_mapping[0] = g->slots;
    s->block_tables[0] = tables;
    s->bt_stride[0] = stride;
    s->max_ctx = max_pos + 1;
    decode_stack_f32(layers, n_layers, final_norm, s, h, residual);
}

/* The argmax of each of M rows of the head's output over x [M, H], into out[r * out_stride]. */
static void head_argmax(const float *x, int64_t M, const greedy_head_t *g, const step_t *s, int64_t *out,
                        int64_t out_stride) {
    const proj_t *p = &g->head;
    project_rows(g->logits, p->N, x, p->K, M, p, s);
    for (int64_t r = 0; r < M; r++) {
        const float *row = g->logits + r * p->N;
        int64_t best = 0;
        for (int64_t v = 1; v < p->N; v++)
            if (row[v] > row[best]) best = v;
        out[r * out_stride] = best;
    }
}

/*
 * The catch-up: rows0 decode rows (tokens0, positions0, tables0 [rows0, stride0]); last[j] is sequence j's last
 * catch-up row, whose hidden state gives its first proposal. Then sequence j proposes steps[j] tokens in all
 * (steps non-increasing, >= 1), reading tables [S, stride] from its last catch-up position + 1 on. Proposals
 * land in out [S, steps[0]]; h and residual hold max(rows0, S) rows of H floats.
 */
void greedy_round_f32(const layer_t *layers, int64_t n_layers, const float *final_norm, step_t *s,
                      const greedy_head_t *g, int64_t rows0, const int64_t *tokens0, const int64_t *positions0,
                      const int64_t *tables0, int64_t stride0, const int64_t *last, int64_t S, const int64_t *steps,
                      const int64_t *tables, int64_t stride, float *h, float *residual, int64_t *out) {
    const int64_t H = s->H, kmax = steps[0];
    forward(layers, n_layers, final_norm, s, g, rows0, tokens0, positions0, tables0, stride0, h, residual);
    for (int64_t j = 0; j < S; j++) {
        memcpy(g->sampled + j * H, h + last[j] * H, (size_t)H * sizeof(float));
        g->positions[j] = positions0[last[j]];
    }
    head_argmax(g->sampled, S, g, s, out, kmax);
    int64_t M = S;
    for (int64_t i = 1; i < kmax; i++) {
        while (M > 0 && steps[M - 1] <= i) M--;
        for (int64_t j = 0; j < M; j++) {
            g->tokens[j] = out[j * kmax + i - 1];
            g->positions[j] += 1;
        }
        forward(layers, n_layers, final_norm, s, g, M, g->tokens, g->positions, tables, stride, h, residual);
        head_argmax(h, M, g, s, out + i, kmax);
    }
}
