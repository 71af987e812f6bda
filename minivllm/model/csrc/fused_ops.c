/*
 * The small per-layer operations of a decoder step, each in one pass: at one token a step is ~30
 * layers of a dozen tiny torch ops each (float casts, views, reductions), and their dispatch cost,
 * not their arithmetic, is what a decode step spends besides reading the weights. float32 only.
 *
 *   add_rmsnorm   residual += xscale * x (when x is given); out = residual * rsqrt(mean(residual^2) + eps) * w
 *                 (xscale: Granite's residual_multiplier, 1 elsewhere)
 *   rmsnorm_groups in place over consecutive groups of a row's columns, one weight for every group (q/k norm
 *                 per head, or over a whole projection)
 *   rope_kv_write neox-style rotary embedding in place on the first `rot` dimensions of the q and k heads of a
 *                 fused qkv row (none when cos_sin is NULL: a NoPE layer), then its
 *                 k and v heads copied into their KV-cache slot (float32, bfloat16 rounded to nearest
 *                 even as torch's conversion does, or int8 with a float16 scale per slot and head:
 *                 kv_quantize_rows, the same arithmetic as attention.quantize_kv)
 *   silu_mul      out = silu(gate) * up for a fused [gate | up] row
 *   gelu_tanh_mul out = gelu_tanh(gate) * up (Gemma's GeGLU)
 *   gelu_tanh     out = gelu_tanh(x) (GPT-2)
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* Rows split over threads only when there are enough of them to pay for the fork. */
#define PAR_ROWS 8
/* ... and per-head norms only when their floats are this many: a one-token step's q and k norms (16 and 8 heads of
 * 64 floats, Qwen3's) opened two parallel regions a layer for ~1 us of work each (no step time measurable either
 * way on 2 threads; more threads wait longer at a region's end). */
#define PAR_FLOATS 16384

/* A residual row r += xscale * xr (xr NULL: nothing added). */
static inline void add_row(float *r, const float *xr, float xscale, int64_t H) {
    if (!xr) return;
    if (xscale == 1.f) {
#pragma omp simd
        for (int64_t i = 0; i < H; i++) r[i] += xr[i];
    } else {
#pragma omp simd
        for (int64_t i = 0; i < H; i++) r[i] += xscale * xr[i];
    }
}

/* out's rows ldo floats apart (csrc/decode_stack.c: where a projection reads them in place, gemm_f32_x_ld(H)). */
void add_rmsnorm_f32_ld(float *residual, const float *x, int64_t ldx, float xscale, const float *w, float eps,
                        float *out, int64_t ldo, int64_t M, int64_t H, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (M >= PAR_ROWS) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        float *r = residual + m * H;
        add_row(r, x ? x + m * ldx : NULL, xscale, H);
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; i++) ss += r[i] * r[i];
        float inv = 1.f / sqrtf(ss / (float)H + eps);
        float *o = out + m * ldo;
#pragma omp simd
        for (int64_t i = 0; i < H; i++) o[i] = w[i] * (r[i] * inv);
    }
}

/* LayerNorm's counterpart (GPT-2): residual += x (x NULL: nothing added), then out = (r - mean) / sqrt(var + eps) * w + b
 * with the biased variance, as torch computes it (two passes over the row, which sits in L1). One pass where the
 * residual add and ATen's layer_norm took two calls of 12-26 us each on GPT-2's 50-token decode rows in the step. */
void add_rmsnorm_f32(float *residual, const float *x, int64_t ldx, float xscale, const float *w, float eps,
                     float *out, int64_t M, int64_t H, int num_threads) {
    add_rmsnorm_f32_ld(residual, x, ldx, xscale, w, eps, out, H, M, H, num_threads);
}

void add_layernorm_f32_ld(float *residual, const float *x, int64_t ldx, const float *w, const float *b, float eps,
                          float *out, int64_t ldo, int64_t M, int64_t H, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (M >= PAR_ROWS) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        float *r = residual + m * H;
        add_row(r, x ? x + m * ldx : NULL, 1.f, H);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < H; i++) sum += r[i];
        const float mean = sum / (float)H;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; i++) ss += (r[i] - mean) * (r[i] - mean);
        const float inv = 1.f / sqrtf(ss / (float)H + eps);
        float *o = out + m * ldo;
#pragma omp simd
        for (int64_t i = 0; i < H; i++) o[i] = (r[i] - mean) * inv * w[i] + b[i];
    }
}

void add_layernorm_f32(float *residual, const float *x, int64_t ldx, const float *w, const float *b, float eps,
                       float *out, int64_t M, int64_t H, int num_threads) {
    add_layernorm_f32_ld(residual, x, ldx, w, b, eps, out, H, M, H, num_threads);
}

/* x: M rows ldx floats apart; columns [0, n * size) normalised in place, group by group, each by w [size]. */
void rmsnorm_groups_f32(float *x, int64_t ldx, int64_t M, int64_t n, int64_t size, const float *w, float eps,
                        int num_threads) {
#pragma omp parallel for collapse(2) num_threads(num_threads) if (M * n * size >= PAR_FLOATS) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < n; g++) {
            float *r = x + m * ldx + g * size;
            float ss = 0.f;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < size; i++) ss += r[i] * r[i];
            const float inv = 1.f / sqrtf(ss / (float)size + eps);
#pragma omp simd
            for (int64_t i = 0; i < size; i++) r[i] = w[i] * (r[i] * inv);
        }
    }
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* n heads of D floats → int8 rows and one float16 scale each: scale = absmax / 127 rounded to float16, values
 * x * (1 / scale) rounded to nearest even (an all-zero head gets scale 0 and zeros). */
static inline void kv_quantize_rows(const float *x, int n, int D, int8_t *q, _Float16 *scale) {
    for (int h = 0; h < n; h++) {
        const float *xr = x + (int64_t)h * D;
        float amax = 0.f;
#pragma omp simd reduction(max : amax)
        for (int i = 0; i < D; i++) amax = fmaxf(amax, fabsf(xr[i]));
        const _Float16 s = (_Float16)fminf(amax / 127.f, 65504.f);
        const float sf = (float)s, inv = sf > 0.f ? 1.f / sf : 0.f;
        int8_t *qr = q + (int64_t)h * D;
#pragma omp simd
        for (int i = 0; i < D; i++) qr[i] = (int8_t)fminf(fmaxf(rintf(xr[i] * inv), -127.f), 127.f);
        scale[h] = s;
    }
}

/* qkv: M rows ldx floats apart, [q (nq heads) | k (nkv heads) | v (nkv heads)] of D floats each. Rotates
 * the first rot dimensions of q and k in place (cos_sin [positions, rot]: cos then sin; NULL: no rotation),
 * then writes k and v into slot slot_mapping[m] of the caches ([slots, nkv, D]: float32 (kv_fmt 0), bfloat16
 * (1) or int8 (2) with scales [slots, nkv] in k_scale / v_scale). */
void rope_kv_write_f32(float *qkv, int64_t ldx, int64_t M, int nq, int nkv, int D, int rot, const int64_t *pos,
                       const float *cos_sin, void *k_cache, void *v_cache, int kv_fmt, _Float16 *k_scale,
                       _Float16 *v_scale, const int64_t *slot_mapping, int num_threads) {
    int half = rot / 2;
    int64_t kv = (int64_t)nkv * D;
#pragma omp parallel for num_threads(num_threads) if (M >= PAR_ROWS) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        float *row = qkv + m * ldx;
        const float *c = cos_sin ? cos_sin + pos[m] * rot : NULL, *s = c ? c + half : NULL;
        for (int h = 0; c && h < nq + nkv; h++) {
            float *x1 = row + (int64_t)h * D, *x2 = x1 + half;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
        const float *ks = row + (int64_t)nq * D, *vs = ks + kv;
        if (kv_fmt == 2) {
            const int64_t slot = slot_mapping[m];
            kv_quantize_rows(ks, nkv, D, (int8_t *)k_cache + slot * kv, k_scale + slot * nkv);
            kv_quantize_rows(vs, nkv, D, (int8_t *)v_cache + slot * kv, v_scale + slot * nkv);
        } else if (kv_fmt == 1) {
            uint16_t *kd = (uint16_t *)k_cache + slot_mapping[m] * kv, *vd = (uint16_t *)v_cache + slot_mapping[m] * kv;
#pragma omp simd
            for (int64_t i = 0; i < kv; i++) {
                kd[i] = to_bf16(ks[i]);
                vd[i] = to_bf16(vs[i]);
            }
        } else {
            float *kd = (float *)k_cache + slot_mapping[m] * kv, *vd = (float *)v_cache + slot_mapping[m] * kv;
#pragma omp simd
            for (int64_t i = 0; i < kv; i++) {
                kd[i] = ks[i];
                vd[i] = vs[i];
            }
        }
    }
}

/* gu: M rows ldg floats apart, [gate (I) | up (I)]; out [M, I], rows ldo floats apart. */
void silu_mul_f32(const float *gu, int64_t ldg, float *out, int64_t ldo, int64_t M, int64_t I, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (M >= PAR_ROWS) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * ldg, *u = g + I;
        float *o = out + m * ldo;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* gelu_tanh of x [M, N] (rows ldx floats apart) into out [M, N] (rows ldo apart): GPT-2's activation. */
void gelu_tanh_f32(const float *x, int64_t ldx, float *out, int64_t ldo, int64_t M, int64_t N, int num_threads) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f; /* sqrt(2 / pi) */
#pragma omp parallel for num_threads(num_threads) if (M >= PAR_ROWS) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float *g = x + m * ldx;
        float *o = out + m * ldo;
#pragma omp simd
        for (int64_t i = 0; i < N; i++) {
            const float v = g[i];
            o[i] = 0.5f * v * (1.f + tanhf(k0 * (v + k1 * v * v * v)));
        }
    }
}

/* gelu with the tanh approximation, as torch's gelu(approximate="tanh"); out rows ldo floats apart. */
void gelu_tanh_mul_f32(const float *gu, int64_t ldg, float *out, int64_t ldo, int64_t M, int64_t I, int num_threads) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f; /* sqrt(2 / pi) */
#pragma omp parallel for num_threads(num_threads) if (M >= PAR_ROWS) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * ldg, *u = g + I;
        float *o = out + m * ldo;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) {
            const float x = g[i];
            o[i] = 0.5f * x * (1.f + tanhf(k0 * (x + k1 * x * x * x))) * u[i];
        }
    }
}
