/* float32 y = x W^T + bias for many tokens (a batched decode step, a prefill chunk) on weights packed in panels.
 *
 * csrc/gemv.c's float rows stream the plain W [N, K] once per MAX_M (16) tokens: right for decode, but at 50 tokens
 * each weight came from memory four times, and oneDNN's packed GEMM ran GPT-2's projections at 390-420 GFLOP/s with
 * the weights cold (from DRAM, as in a step) on a 2-core Zen 5. Here W is packed as panels of PW = 2 VL output
 * columns, P [N / PW][K][PW] (zero columns past N), so a panel's k-th row is two vectors; a tile of T tokens keeps
 * 2T accumulators in registers and per k loads two vectors and broadcasts T values of x: 2T FMAs to 2 + T loads, no
 * horizontal sums. A panel (K * PW floats: 96 KiB at K = 768 with AVX-512) stays in L2 across the tiles of all
 * tokens, and each tile prefetches the next panel's rows into L2 as it reads its own (the hardware prefetcher does
 * not follow a GEMM's panel order). Threads take contiguous runs of panels, so the panel prefetched is their own.
 * Same shapes cold, 2 threads: 440-510 GFLOP/s against oneDNN's 400-415 at 50 tokens; 1.15-1.6x at 20 tokens. */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd_width.h"

#define PW (2 * VL) /* output columns a panel */
#if VL == 16
#define TT 14 /* tokens a tile: 2 * 14 accumulators + 2 weight vectors of AVX-512's 32 registers (tiles of 10:
                    * 3-6% slower at 20-64 tokens, 8% at 12) */
#else
#define TT 6 /* AVX2's 16 registers: 12 accumulators + 2 */
#endif

int gemm_f32_panel_width(void) { return PW; }

static inline __attribute__((always_inline)) void tile(float *out, int64_t ldo, const float *x, int64_t ldx,
                                                       int64_t K, const float *pp, const float *next, int T,
                                                       int64_t ncols, const float *bias) {
    vf a0[TT], a1[TT];
    for (int j = 0; j < T; j++) a0[j] = a1[j] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        const vf w0 = ldv(pp + k * PW), w1 = ldv(pp + k * PW + VL);
        for (int b = 0; b < PW * 4; b += 64) __builtin_prefetch((const char *)(next + k * PW) + b, 0, 2);
        for (int j = 0; j < T; j++) {
            const vf xb = (vf){0} + x[j * ldx + k];
            a0[j] += w0 * xb;
            a1[j] += w1 * xb;
        }
    }
    float row[PW];
    for (int j = 0; j < T; j++) {
        memcpy(row, &a0[j], sizeof a0[j]);
        memcpy(row + VL, &a1[j], sizeof a1[j]);
        float *o = out + j * ldo;
        if (bias)
            for (int64_t c = 0; c < ncols; c++) o[c] = row[c] + bias[c];
        else
            memcpy(o, row, ncols * sizeof(float));
    }
}

/* out [M, N] rows ldo floats apart; x [M, K] rows ldx apart; P the panels (gemm_f32_panel_width() columns each);
 * bias [N] or NULL. */
void gemm_f32_panels(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N,
                     const float *P, const float *bias, int num_threads) {
    const int64_t np = (N + PW - 1) / PW;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < np; p++) {
        const float *pp = P + p * K * PW, *next = p + 1 < np ? pp + K * PW : pp;
        const int64_t c0 = p * PW, ncols = N - c0 < PW ? N - c0 : PW;
        const float *b = bias ? bias + c0 : NULL;
        int m = 0;
        for (; m + TT <= M; m += TT) tile(out + m * ldo + c0, ldo, x + m * ldx, ldx, K, pp, next, TT, ncols, b);
        switch (M - m) { /* (each count its own unrolled copy) */
#define LAST(t) case t: tile(out + m * ldo + c0, ldo, x + m * ldx, ldx, K, pp, next, t, ncols, b); break;
            LAST(1) LAST(2) LAST(3) LAST(4) LAST(5)
#if TT > 6
            LAST(6) LAST(7) LAST(8) LAST(9) LAST(10) LAST(11) LAST(12) LAST(13)
#endif
#undef LAST
            default: break;
        }
    }
}
