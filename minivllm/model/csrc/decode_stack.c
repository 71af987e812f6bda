/*
 * A decoder stack for a step whose every token is a decode, in one call, for every family of
 * model/models/decoder.py.
 *
 * Each layer's work at one token is a dozen small kernels (norms, qkv, q/k norm, rope + KV write, attention,
 * o_proj, gate_up, the gated activation, down) that already run natively; called one by one from Python,
 * their dispatch (module calls, views, ctypes marshalling: ~90 us a layer) was a tenth to a third of a
 * batch-1 step. Here the same kernels run back to back from C, with every activation in one buffer the
 * caller owns, so a step costs one foreign call however many layers the model has.
 * A layer's variants are data, not code: norms before and/or after each sublayer (NULL where the family has
 * none), q/k norms per head or over the projection, the layer's rope table (NULL: NoPE) and window, the
 * residual multiplier, attention soft-capping and the MLP's activation; RMSNorm or LayerNorm (GPT-2, whose MLP's
 * c_fc / c_proj sit in gate_up / down with an ungated GELU).
 * A layer's MLP may be a mixture of experts (csrc/moe_decode.c).
 * float32 activations; KV cache float32, bfloat16 or int8 (+ float16 scales); weights in any format of
 * csrc/gemv.c.
 */
#include <stdint.h>
#include <string.h>

#include "decode_stack.h"

void add_rmsnorm_f32_ld(float *residual, const float *x, int64_t ldx, float xscale, const float *w, float eps,
                        float *out, int64_t ldo, int64_t M, int64_t H, int num_threads);
void add_layernorm_f32_ld(float *residual, const float *x, int64_t ldx, const float *w, const float *b, float eps,
                          float *out, int64_t ldo, int64_t M, int64_t H, int num_threads);
void rmsnorm_groups_f32(float *x, int64_t ldx, int64_t M, int64_t n, int64_t size, const float *w, float eps,
                        int num_threads);
void rope_kv_write_f32(float *qkv, int64_t ldx, int64_t M, int nq, int nkv, int D, int rot, const int64_t *pos,
                       const float *cos_sin, void *k_cache, void *v_cache, int kv_fmt, _Float16 *k_scale,
                       _Float16 *v_scale, const int64_t *slot_mapping, int num_threads);
void paged_attention_f32_ld(float *out, int64_t out_stride, const float *q, int64_t q_stride, const void *k_cache,
                           const void *v_cache, int kv_fmt, const _Float16 *k_scale, const _Float16 *v_scale,
                           const int64_t *block_tables, int64_t bt_stride, const int64_t *positions,
                           int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim, int block_size,
                           float scale, float softcap, int64_t window, int64_t sinks, int64_t max_ctx, float *scratch,
                           int num_threads);

/* out = x W^T (+ b) for the step's M rows of x, ldx floats apart. */
static void project(float *out, const float *x, int64_t ldx, const proj_t *p, const step_t *s) {
    project_rows(out, proj_n(p), x, ldx, s->M, p, s);
}

/* residual += res_scale x pending (NULL: nothing), normed into out (rows ldo apart) by the family's norm (bias:
 * LayerNorm's). */
static void add_norm(float *residual, const float *pending, const float *norm, const float *bias, float *out,
                     int64_t ldo, const step_t *s) {
    const int64_t M = s->M, H = s->H;
    if (s->norm_kind == 1)
        add_layernorm_f32_ld(residual, pending, H, norm, bias, s->eps, out, ldo, M, H, (int)s->num_threads);
    else
        add_rmsnorm_f32_ld(residual, pending, H, s->res_scale, norm, s->eps, out, ldo, M, H, (int)s->num_threads);
}

/* The input of a sublayer: `pending` (the previous sublayer's output, NULL for the first) joins the residual
 * stream, scaled; then the stream is normed into `normed` (returned; rows *ld apart, as asked) or, without a norm,
 * read as it is (rows H apart: *ld set so). */
static const float *sublayer_input(float *residual, const float *pending, const float *norm, const float *norm_b,
                                   float *normed, int64_t *ld, const step_t *s) {
    const int64_t M = s->M, H = s->H;
    if (norm) {
        add_norm(residual, pending, norm, norm_b, normed, *ld, s);
        return normed;
    }
    *ld = H;
    if (pending)
        for (int64_t i = 0; i < M * H; i++) residual[i] += s->res_scale * pending[i];
    return residual;
}

/*
 * h [M, H]: the token embeddings in, the final-normed hidden states out. residual [M, H] is work space.
 * s->work holds the activations: M * (H + QKV + nq*D + H + 2I + I + 96) floats. At several rows, the normed
 * stream, attention's output and the MLP's activation (the inputs of the qkv / gate_up, o and down projections) sit
 * in rows gemm_f32_x_ld(width) apart (up to 31 floats more): where rows 4 KiB apart would crowd one L1 set (a 1B
 * model's 2048 and 8192, GPT-2's 3072), csrc/gemm_f32.c then reads them in place rather than copying them first.
 */
void decode_stack_f32(const layer_t *layers, int64_t n_layers, const float *final_norm, const step_t *s, float *h,
                      float *residual) {
    const int64_t M = s->M, H = s->H, I = s->I, qd = s->nq * s->D, kvd = s->nkv * s->D, qkv_n = qd + 2 * kvd;
    const int nt = (int)s->num_threads;
    const int64_t ldn = M > 1 ? gemm_f32_x_ld(H) : H, ldq = M > 1 ? gemm_f32_x_ld(qd) : qd;
    const int64_t lda = M > 1 ? gemm_f32_x_ld(I) : I;
    float *normed = s->work, *qkv = normed + M * ldn, *attn = qkv + M * qkv_n, *proj = attn + M * ldq;
    float *gu = proj + M * H, *act = gu + M * 2 * I;

    memcpy(residual, h, (size_t)(M * H) * sizeof(float));
    for (int64_t l = 0; l < n_layers; l++) {
        const layer_t *L = layers + l;
        /* The first layer reads the embeddings; later ones first add the previous MLP's output. */
        int64_t ldx = ldn;
        const float *x = sublayer_input(residual, l ? proj : NULL, L->attn_norm, L->attn_norm_b, normed, &ldx, s);
        if (x == normed) x = bf16_input(normed, M * ldn, s);
        project(qkv, x, ldx, &L->qkv, s);
        if (L->q_norm) rmsnorm_groups_f32(qkv, qkv_n, M, qd / L->q_norm_size, L->q_norm_size, L->q_norm, s->eps, nt);
        if (L->k_norm)
            rmsnorm_groups_f32(qkv + qd, qkv_n, M, kvd / L->k_norm_size, L->k_norm_size, L->k_norm, s->eps, nt);
        rope_kv_write_f32(qkv, qkv_n, M, (int)s->nq, (int)s->nkv, (int)s->D, (int)L->rot, s->positions, L->cos_sin,
                          L->k_cache, L->v_cache, (int)s->kv_fmt, L->k_scale, L->v_scale, s->slot_mapping[L->group],
                          nt);
        paged_attention_f32_ld(attn, ldq, qkv, qkv_n, L->k_cache, L->v_cache, (int)s->kv_fmt, L->k_scale, L->v_scale,
                               s->block_tables[L->group], s->bt_stride[L->group], s->positions, M, (int)s->nq,
                               (int)s->nkv, (int)s->D, (int)s->block_size, s->scale, s->softcap, L->window, s->sinks,
                               s->max_ctx, s->attn_scratch, nt);
        project(proj, bf16_input(attn, M * ldq, s), ldq, &L->o, s);
        if (L->attn_out_norm) add_rmsnorm_f32_ld(proj, NULL, H, 1.f, L->attn_out_norm, s->eps, proj, H, M, H, nt);
        /* (a mixture of experts reads its input rows H apart) */
        ldx = L->moe ? H : ldn;
        x = sublayer_input(residual, proj, L->mlp_norm, L->mlp_norm_b, normed, &ldx, s);
        if (x == normed) x = bf16_input(normed, M * ldx, s);
        if (L->moe) {
            moe_f32(proj, x, L->moe, s);
        } else {
            project(gu, x, ldx, &L->gate_up, s);
            gated_act(gu, act, lda, M, I, s);
            project(proj, bf16_input(act, M * lda, s), lda, &L->down, s);
        }
        if (L->mlp_out_norm) add_rmsnorm_f32_ld(proj, NULL, H, 1.f, L->mlp_out_norm, s->eps, proj, H, M, H, nt);
    }
    add_norm(residual, n_layers ? proj : NULL, final_norm, s->final_norm_b, h, H, s);
    bf16_input(h, M * H, s); /* (the head's input: bf16 as the module path's, in csrc/greedy_loop.c's head too) */
}
