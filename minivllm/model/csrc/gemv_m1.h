/* csrc/gemv.c's kernels for one token against float weights (f32 or bf16); included there after Layer, ld16 and
 * bf16_to_f32. */
#ifndef MINIVLLM_GEMV_M1_H
#define MINIVLLM_GEMV_M1_H

#include "simd_width.h"

typedef uint16_t vfh __attribute__((vector_size(VL * 2)));
typedef uint32_t vfu __attribute__((vector_size(VL * 4)));

INLINE vf ldv_bf16(const uint16_t *p) {
    vfh h;
    memcpy(&h, p, sizeof h);
    vfu u = __builtin_convertvector(h, vfu) << 16;
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE float hsumv(vf v) {
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* One token against four consecutive weight rows, each load of x serving all four: one row per pass streamed
 * 16-18 GB/s (21-26 with 32-byte vectors) on a 2-core AVX2 EPYC, four rows 27-32, oneDNN's plain-weight GEMM
 * 19-25 (same probe: 24 distinct 512x2048 .. 2048x8192 weights, one token). Fewer loads per FMA, and four
 * streams in flight per core. */
INLINE void dense_rows4_m1(float *out, const float *x, const Layer *L, int bf16, int64_t n) {
    const int64_t K = L->K;
    vf a[4][2] = {{{0}}};
    const float *wf = (const float *)L->w + n * K;
    const uint16_t *wh = (const uint16_t *)L->w + n * K;
#define WV(r, k) (bf16 ? ldv_bf16(wh + (r) * K + (k)) : ldv(wf + (r) * K + (k)))
    int64_t k = 0;
    for (; k + 2 * VL <= K; k += 2 * VL) {
        const vf x0 = ldv(x + k), x1 = ldv(x + k + VL);
        for (int r = 0; r < 4; r++) {
            a[r][0] += x0 * WV(r, k);
            a[r][1] += x1 * WV(r, k + VL);
        }
    }
#undef WV
    for (int r = 0; r < 4; r++) {
        float s = hsumv(a[r][0] + a[r][1]);
        for (int64_t j = k; j < K; j++) s += x[j] * (bf16 ? bf16_to_f32(wh[r * K + j]) : wf[r * K + j]);
        out[n + r] = s + (L->bias ? L->bias[n + r] : 0.f);
    }
}

/* One token against one weight row (a share's last rows): four accumulators held in registers. */
INLINE void dense_row_m1(float *out, const float *x, const Layer *L, int bf16, int64_t n) {
    const int64_t K = L->K;
    const float *wf = (const float *)L->w + n * K;
    const uint16_t *wh = (const uint16_t *)L->w + n * K;
    vf a[4] = {{0}};
    int64_t k = 0;
    for (; k + 4 * VL <= K; k += 4 * VL)
        for (int i = 0; i < 4; i++) a[i] += ldv(x + k + i * VL) * (bf16 ? ldv_bf16(wh + k + i * VL) : ldv(wf + k + i * VL));
    for (; k + VL <= K; k += VL) a[0] += ldv(x + k) * (bf16 ? ldv_bf16(wh + k) : ldv(wf + k));
    float s = hsumv((a[0] + a[1]) + (a[2] + a[3]));
    for (int64_t j = k; j < K; j++) s += x[j] * (bf16 ? bf16_to_f32(wh[j]) : wf[j]);
    out[n] = s + (L->bias ? L->bias[n] : 0.f);
}

#endif
