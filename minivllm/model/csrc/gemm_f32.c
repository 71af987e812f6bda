/* float32 y = x W^T + bias for many tokens (a batched decode step, a prefill chunk) on weights packed in panels.
 *
 * csrc/gemv.c's float rows stream the plain W [N, K] once per MAX_M (16) tokens: right for decode, but at 50 tokens
 * each weight came from memory four times, and oneDNN's packed GEMM ran GPT-2's projections at 390-420 GFLOP/s with
 * the weights cold (from DRAM, as in a step) on a 2-core Zen 5. Here W is packed as panels of PW = 2 VL output
 * columns, P [N / PW][K][PW] (zero columns past N), so a panel's k-th row is two vectors; a tile of T tokens keeps
 * 2T accumulators in registers and per k loads two vectors and broadcasts T values of x: 2T FMAs to 2 + T loads, no
 * horizontal sums. A panel (K * PW floats: 96 KiB at K = 768 with AVX-512) stays in L2 across the tiles of all
 * tokens, and each tile of more than STREAM_T tokens prefetches the next panel's rows into L2 as it reads its own
 * (the hardware prefetcher does not follow a GEMM's panel order). Threads take contiguous runs of panels, so the
 * panel prefetched is their own.
 * Same shapes cold, 2 threads: 440-510 GFLOP/s against oneDNN's 400-415 at 50 tokens; 1.15-1.6x at 20 tokens. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_width.h"

#define PW (2 * VL) /* output columns a panel */
#if VL == 16
#define TT 14 /* tokens a tile: 2 * 14 accumulators + 2 weight vectors of AVX-512's 32 registers (tiles of 10:
                    * 3-6% slower at 20-64 tokens, 8% at 12) */
#else
#define TT 6 /* AVX2's 16 registers: 12 accumulators + 2 */
#endif

/* A tile of at most this many tokens issues no prefetch of the next panel: at so few tokens a panel is one stream
 * read once (a 1B model's panels alone serve its decode: model/weight_layout.py), which the hardware prefetcher
 * follows, and a second stream into L2 only cost. 1B-shaped projections from memory (six layers, 1.46 GB a pass, 2
 * threads, a Zen 4; per-round ratios over 41 alternating rounds): 1 / 2 / 4 tokens 0.95x / 0.94x / 0.91x the time
 * with the prefetch, 6 tokens 0.99x; at 8 tokens skipping it tied, at 14 it cost 1.19x. */
#define STREAM_T 4

int gemm_f32_panel_width(void) { return PW; }

static inline __attribute__((always_inline)) void tile(float *out, int64_t ldo, const float *x, int64_t ldx,
                                                       int64_t K, const float *pp, const float *next, int T,
                                                       int64_t ncols, const float *bias) {
    vf a0[TT], a1[TT];
    for (int j = 0; j < T; j++) a0[j] = a1[j] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        const vf w0 = ldv(pp + k * PW), w1 = ldv(pp + k * PW + VL);
        if (T > STREAM_T)
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

/* Whether a tile's rows of x, ldx floats apart, crowd into few L1 sets: x86's L1 caches index 64 sets by the
 * address's bits 6-11, so rows a multiple of 4 KiB apart (K = 1024, 2048, 3072, ... floats) all fall in one set,
 * more rows than its ways, and every broadcast missed L1: a 1B model's K = 2048 and GPT-2's down projection (K =
 * 3072) ran at 95-110 GFLOP/s where the same x copied to rows 16 floats longer ran at 145-185 (2 threads, a Zen 4). */
static int rows_conflict(int64_t ldx) {
    int per_set[64] = {0}, worst = 0;
    for (int j = 0; j < TT; j++) {
        const int set = (int)(((uint64_t)j * (uint64_t)ldx * 4 / 64) % 64);
        if (++per_set[set] > worst) worst = per_set[set];
    }
    return worst > 4; /* (half an 8-way set's ways: the panel's lines need the rest) */
}

#define PAD_MAX_FLOATS (8 << 20) /* 32 MiB: a larger x (a long prefill of a wide layer) goes unpadded */

/* The row stride a producer of x [M, K] gives its rows so that this GEMM reads them in place: K where its rows
 * spread over L1's sets, else K rounded up to 16 floats plus 16 (what the copy below uses). csrc/decode_stack.c
 * writes its projections' inputs so (the normed stream, attention's output, the MLP's activation), and their
 * copies go. */
int64_t gemm_f32_x_ld(int64_t K) { return rows_conflict(K) ? (K + 15) / 16 * 16 + 16 : K; }

/* out [M, N] rows ldo floats apart; x [M, K] rows ldx apart; P the panels (gemm_f32_panel_width() columns each);
 * bias [N] or NULL. Where x's rows conflict in L1 (rows_conflict), the threads first copy it to rows K + 16 floats
 * apart, in a buffer of the calling thread's (kept for its next calls). */
void gemm_f32_panels(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N,
                     const float *P, const float *bias, int num_threads) {
    static __thread float *pad;
    static __thread int64_t pad_floats;
    const int64_t np = (N + PW - 1) / PW, ldp = (K + 15) / 16 * 16 + 16;
    const float *src = x;
    const int64_t ldsrc = ldx;
    if (M > 1 && rows_conflict(ldx) && (int64_t)M * ldp <= PAD_MAX_FLOATS) {
        if (pad_floats < (int64_t)M * ldp) {
            free(pad);
            pad = aligned_alloc(64, (size_t)M * ldp * sizeof(float));
            pad_floats = pad ? (int64_t)M * ldp : 0;
        }
        if (pad) {
            x = pad;
            ldx = ldp;
        }
    }
    float *const buf = (float *)x; /* (pad itself is the calling thread's: the team's other threads see their own) */
#pragma omp parallel num_threads(num_threads)
    {
    if (x != src) {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) memcpy(buf + m * ldp, src + m * ldsrc, K * sizeof(float));
    }
#pragma omp for schedule(static)
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
}
