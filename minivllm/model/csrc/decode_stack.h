/*
 * The tables csrc/decode_stack.c and csrc/moe_decode.c share (mirrored by model/decode_stack.py's ctypes
 * structures: change both together).
 */
#ifndef MINIVLLM_DECODE_STACK_H
#define MINIVLLM_DECODE_STACK_H
#include <stdint.h>
#include <string.h>

/* One projection as csrc/gemv.c takes it (the fields of cpu_kernels.GemvWeights); `next`: the part holding the
 * output columns after these N (model/split_linear.py: a module of two weight types), or NULL; `panels`: a float32
 * projection's weight packed for csrc/gemm_f32.c (cpu_kernels.GemmPanels), which it runs on more than
 * step_t.panels_past rows as layers.Linear.forward_native does, or NULL. A weight held as panels alone
 * (model/weight_layout.py) has no rows: w NULL, and its panels run at every row count. */
typedef struct proj {
    const void *w, *scale, *mins;
    const float *bias;
    int64_t K, N, G;
    int64_t fmt;
    const struct proj *next;
    const float *panels;
} proj_t;

/* A mixture of experts in a layer's MLP place (model/moe.py's SparseMoE). */
typedef struct {
    int64_t E, k, I;       /* experts, experts per token, each expert's intermediate size */
    int64_t norm_topk;     /* renormalise the k routing weights to sum 1 */
    proj_t router;         /* [E, H]: float logits, softmax over all experts in float32 */
    const proj_t *gate_up; /* [E]: [2I, H] each, gate rows first */
    const proj_t *down;    /* [E]: [H, I] each */
    int64_t shared_I;      /* Qwen2-MoE's shared expert's intermediate size (0: none) */
    proj_t shared_gate_up, shared_down, shared_gate; /* the shared expert and its [1, H] sigmoid gate */
    int64_t *expert_tokens; /* [E] tokens routed to each expert (the /metrics counters) */
} moe_t;

typedef struct {
    /* Norms before attention, after attention, before the MLP, after the MLP (NULL: the family has none). */
    const float *attn_norm, *attn_out_norm, *mlp_norm, *mlp_out_norm;
    const float *q_norm, *k_norm; /* NULL: none; else one weight per group of q_norm_size / k_norm_size */
    int64_t q_norm_size, k_norm_size;
    const float *cos_sin; /* [positions, rot]; NULL: no rotary (NoPE layer) */
    int64_t rot, window;  /* window <= 0: full attention */
    int64_t group;        /* its KV group: which slots and block tables of the step it reads */
    proj_t qkv, o, gate_up, down; /* gate_up / down unused where moe is set */
    void *k_cache, *v_cache;
    _Float16 *k_scale, *v_scale; /* int8 caches only */
    const moe_t *moe;            /* NULL: the dense gated MLP */
    const float *attn_norm_b, *mlp_norm_b; /* LayerNorm's biases (step_t.norm_kind 1) */
} layer_t;

#define MAX_KV_GROUPS 4

/* The model's shape and the step's inputs (attention metadata of an all-decode step; slots and block tables per
 * KV group: the layers of one attention window share a pool). */
typedef struct {
    int64_t M, H, I;
    int64_t nq, nkv, D, block_size;
    float eps, scale, softcap, res_scale;
    int64_t act; /* 0: SiLU, 1: GeLU-tanh (both gated: gate_up [2I, H]), 2: GeLU-tanh of gate_up [I, H] (GPT-2) */
    const int64_t *positions;
    const int64_t *slot_mapping[MAX_KV_GROUPS], *block_tables[MAX_KV_GROUPS];
    int64_t bt_stride[MAX_KV_GROUPS], sinks, max_ctx;
    float *gemv_scratch, *attn_scratch, *work;
    int64_t num_threads, kv_fmt;
    float *moe_work;  /* max(M, k) (E + k + 2H + 3 Imax) floats, where a layer has experts (csrc/moe_decode.c) */
    int64_t *moe_ids; /* 3 M k int64 */
    int64_t x_bf16;   /* a bfloat16 model: projection inputs rounded to bf16 (bf16_input, below) */
    int64_t panels_past; /* layers.PANELS_PAST: more rows than this run a projection's panels where it has them */
    int64_t norm_kind;   /* 0: RMSNorm; 1: LayerNorm with biases (GPT-2; res_scale 1) */
    const float *final_norm_b;
} step_t;

void linear_gemv(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, int fmt,
                 const void *w, const void *scale, const void *mins, int64_t G, const float *bias, float *scratch,
                 int num_threads);
int linear_gemv_m1_many(float *out, int64_t ldo, const float *x, int64_t ldx, int k, int64_t K, int64_t N, int fmt,
                        const void *const *w, const void *const *scale, const void *const *mins, int64_t G,
                        const float *const *bias, float *scratch, int num_threads);
void gemm_f32_panels(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N,
                     const float *P, const float *bias, int num_threads);
int64_t gemm_f32_x_ld(int64_t K);
void silu_mul_f32(const float *gu, int64_t ldg, float *out, int64_t ldo, int64_t M, int64_t I, int num_threads);
void gelu_tanh_f32(const float *x, int64_t ldx, float *out, int64_t ldo, int64_t M, int64_t N, int num_threads);
void gelu_tanh_mul_f32(const float *gu, int64_t ldg, float *out, int64_t ldo, int64_t M, int64_t I,
                       int num_threads);

/* A projection's input rounded to bfloat16 in place (to nearest even; NaN kept) where the model is bf16 (x_bf16): the
 * module path's activations are bf16 there, and a bf16 x lets bf16 weights take the dot-product rows (csrc/
 * gemv_bf16dot.h: 1.3x the float rows' rate on 8192-wide rows on a Zen 4). Never the residual stream itself (a
 * family without a norm before a sublayer projects the stream as it is: those projections keep the float rows). */
static inline float *bf16_input(float *x, int64_t n, const step_t *s) {
    if (s->x_bf16)
        for (int64_t i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, x + i, sizeof u);
            if ((u & 0x7fffffffu) <= 0x7f800000u) u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
            memcpy(x + i, &u, sizeof u);
        }
    return x;
}

/* Output columns of a projection and the parts after it. */
static inline int64_t proj_n(const proj_t *p) {
    int64_t n = 0;
    for (; p; p = p->next) n += p->N;
    return n;
}

/* out [rows, proj_n(p)] (ldo floats apart) = x [rows, p->K] (ldx apart) W^T + b, part by part: on the panels past
 * panels_past rows where a part has them (at any rows where they are its only layout), else csrc/gemv.c's kernel of
 * its format. */
static inline void project_rows(float *out, int64_t ldo, const float *x, int64_t ldx, int64_t rows, const proj_t *p,
                                const step_t *s) {
    for (; p; out += p->N, p = p->next)
        if (p->panels && (rows > s->panels_past || !p->w))
            gemm_f32_panels(out, ldo, x, ldx, (int)rows, p->K, p->N, p->panels, p->bias, (int)s->num_threads);
        else
            linear_gemv(out, ldo, x, ldx, (int)rows, p->K, p->N, (int)p->fmt, p->w, p->scale, p->mins, p->G,
                        p->bias, s->gemv_scratch, (int)s->num_threads);
}

/* The gated activation of gu [rows, 2I] (gate columns first) into out [rows, I] (rows ldo floats apart); act 2:
 * GeLU-tanh of gu [rows, I]. */
static inline void gated_act(const float *gu, float *out, int64_t ldo, int64_t rows, int64_t I, const step_t *s) {
    if (s->act == 2)
        gelu_tanh_f32(gu, I, out, ldo, rows, I, (int)s->num_threads);
    else if (s->act == 1)
        gelu_tanh_mul_f32(gu, 2 * I, out, ldo, rows, I, (int)s->num_threads);
    else
        silu_mul_f32(gu, 2 * I, out, ldo, rows, I, (int)s->num_threads);
}

void moe_f32(float *out, const float *x, const moe_t *e, const step_t *s);

#endif
