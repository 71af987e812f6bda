/* csrc/gemv.c's kernels for one token against float weights (f32 or bf16); included there after Layer and
 * bf16_to_f32. */
#ifndef MINIVLLM_GEMV_M1_H
#define MINIVLLM_GEMV_M1_H

#include "simd_width.h"

typedef uint32_t vfu __attribute__((vector_size(VL * 4)));

INLINE float hsumv(vf v) {
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* Weight rows per pass at one token: eight where 32 vector registers hold their 16 accumulators (AVX-512), four
 * on AVX2's 16. */
#define M1_ROWS (VL == 16 ? 8 : 4)

/* How the one-token float rows (f32 and bf16; W8A8's too, csrc/gemv_avx512.h) stream; gemv.c holds the order,
 * model/row_order.py sets it at start-up by timing each on the model's own weights:
 * - M1_PASS: M1_ROWS rows a pass, each load of x serving them all;
 * - M1_ONE: each row whole before the next (dense_row_m1, bf16_row_m1), one sequential stream per thread;
 * - M1_PAIRS: two rows a pass, their loads alternating cache line by cache line, two streams per thread.
 * Which streams fastest is the memory system's business. On a 2-vCPU Zen 4 EPYC the passes' M1_ROWS interleaved
 * streams of short rows starved the hardware prefetcher: a 135M model's one-token decode stack (576-float rows) took
 * 1.34-1.40x as long as row by row (2 rows interleaved, one row's two lines then the other's: 1.09x), a 1B model's
 * 1.19x; bf16 rows streamed 16 -> 29 GB/s row by row. On a 2-vCPU Sapphire Rapids-class Xeon neither differed
 * (a 135M model's 538 MB of f32 rows 26-28 GB/s either way, while its bandwidth probe read 32-33), but two rows whose
 * loads alternate line by line read the same rows at 32-33 GB/s (8192-wide rows 32 -> 36), a 135M F32 decode 1.125x
 * (same process, alternating); on an AVX2 EPYC four rows a pass had streamed 1.2x one row.
 * (The orders' values and the setting itself: csrc/gemv_rows.h, which the GGUF block kernels share: their one-token
 * rows go two a pass where the order is M1_PAIRS, else one by one.) */

/* One token against one f32 weight row (a share's last rows). */
INLINE void dense_row_m1_body(float *out, const float *x, const Layer *L, int64_t n);

/* One token against R consecutive f32 weight rows (M1_ROWS, or 2 for M1_PAIRS), each load of x serving them all,
 * the rows' loads at each offset one after another: one row a pass streamed 16-18 GB/s (21-26 with 32-byte
 * vectors) on a 2-core AVX2 EPYC, four rows 27-32, oneDNN's plain-weight GEMM 19-25 (same probe: 24 distinct
 * 512x2048 .. 2048x8192 weights, one token); on an AVX-512 Xeon eight rows streamed 1.05-1.08x four. */
INLINE void dense_pass_m1(float *out, const float *x, const Layer *L, int64_t n, const int R) {
    const int64_t K = L->K;
    vf a[M1_ROWS][2] = {{{0}}};
    const float *wf = (const float *)L->w + n * K;
    int64_t k = 0;
    for (; k + 2 * VL <= K; k += 2 * VL)
        for (int i = 0; i < 2; i++) {
            const vf xi = ldv(x + k + i * VL);
            if (VL == 16 || i == 0) /* (each 64-byte line once) */
                for (int r = 0; r < R; r++) PREFETCH_L2(wf + r * K + k + i * VL, L->pf);
            for (int r = 0; r < R; r++) a[r][i] += xi * ldv(wf + r * K + k + i * VL);
        }
    for (int r = 0; r < R; r++) {
        float s = hsumv(a[r][0] + a[r][1]);
        for (int64_t j = k; j < K; j++) s += x[j] * wf[r * K + j];
        out[n + r] = s + (L->bias ? L->bias[n + r] : 0.f);
    }
}

/* M1_ROWS rows from n in the order `order` (gemv_m1_order as the caller read it once before its parallel region: a
 * matmul's rows in one order). Not inlined, nor dense_row_m1 below: under -ffast-math each inlined copy may sum in
 * its own order, and linear_gemv_m1_many's rows must equal linear_gemv's bit for bit (an AVX2 EPYC's build summed a
 * share's last row differently in the two). One call per M1_ROWS rows or per tail row costs nothing measurable. */
static __attribute__((noinline, unused)) void dense_rows_m1(float *out, const float *x, const Layer *L, int64_t n,
                                                             int order) {
    if (order == M1_ONE)
        for (int r = 0; r < M1_ROWS; r++) dense_row_m1_body(out, x, L, n + r);
    else if (order == M1_PAIRS)
        for (int r = 0; r < M1_ROWS; r += 2) dense_pass_m1(out, x, L, n + r, 2);
    else
        dense_pass_m1(out, x, L, n, M1_ROWS);
}

/* One token against one f32 weight row (a share's last rows): four accumulators held in registers. */
INLINE void dense_row_m1_body(float *out, const float *x, const Layer *L, int64_t n) {
    const int64_t K = L->K;
    const float *wf = (const float *)L->w + n * K;
    vf a[4] = {{0}};
    int64_t k = 0;
    for (; k + 4 * VL <= K; k += 4 * VL)
        for (int i = 0; i < 4; i++) {
            if (VL == 16 || i % 2 == 0) PREFETCH_L2(wf + k + i * VL, L->pf);
            a[i] += ldv(x + k + i * VL) * ldv(wf + k + i * VL);
        }
    for (; k + VL <= K; k += VL) a[0] += ldv(x + k) * ldv(wf + k);
    float s = hsumv((a[0] + a[1]) + (a[2] + a[3]));
    for (int64_t j = k; j < K; j++) s += x[j] * wf[j];
    out[n] = s + (L->bias ? L->bias[n] : 0.f);
}

/* A share's last rows, one compiled body for every caller (see dense_rows_m1). */
static __attribute__((noinline, unused)) void dense_row_m1(float *out, const float *x, const Layer *L, int64_t n) {
    dense_row_m1_body(out, x, L, n);
}

/* bf16 weights at one token without a widening shuffle: a vector of 2*VL bf16 read as VL 32-bit lanes holds the
 * even-indexed weights in its low halves (shift them up) and the odd ones in its high halves (mask the low half
 * off), so x is split once per call into each 2*VL chunk's even then odd entries (bf16_split_x) and every 2*VL
 * weights cost one load, a shift, an and and two FMAs. The widening load (vpmovzxwd) it replaces runs on the one
 * shuffle port: a 2-thread chain of 1B-shaped bf16 projections streamed 19 GB/s with it where f32 streamed 23, and
 * 20-24 split (built for Haswell: 14 -> 21); one core on weights in L2 went 1.9-2.7x as fast. The scratch that
 * holds the split x is the caller's (linear_gemv's scratch: >= K floats). */
INLINE void bf16_split_x(float *xs, const float *x, int64_t K) {
    for (int64_t k = 0; k + 2 * VL <= K; k += 2 * VL)
        for (int j = 0; j < VL; j++) {
            xs[k + j] = x[k + 2 * j];
            xs[k + VL + j] = x[k + 2 * j + 1];
        }
}

INLINE void ld_bf16_pair(const uint16_t *p, vf *even, vf *odd) {
    vfu u;
    memcpy(&u, p, sizeof u);
    const vfu e = u << 16, o = u & 0xffff0000u;
    memcpy(even, &e, sizeof e);
    memcpy(odd, &o, sizeof o);
}

/* One bf16 row against x split by bf16_split_x (xs; x itself for the tail past the last 2*VL chunk). */
INLINE void bf16_row_m1(float *out, const float *x, const float *xs, const Layer *L, int64_t n);

/* R consecutive bf16 rows (M1_ROWS, or 2 for M1_PAIRS) a pass, each load of xs serving them, one 2*VL chunk of each
 * row after another. */
INLINE void bf16_pass_m1(float *out, const float *x, const float *xs, const Layer *L, int64_t n, const int R) {
    const int64_t K = L->K;
    const uint16_t *wh = (const uint16_t *)L->w + n * K;
    vf a[M1_ROWS][2] = {{{0}}};
    int64_t k = 0;
    for (; k + 2 * VL <= K; k += 2 * VL) {
        const vf xe = ldv(xs + k), xo = ldv(xs + k + VL);
        if (VL == 16 || k % (4 * VL) == 0) /* (2 * VL bf16: a 64-byte line, or half of one) */
            for (int r = 0; r < R; r++) PREFETCH_L2(wh + r * K + k, L->pf);
        for (int r = 0; r < R; r++) {
            vf we, wo;
            ld_bf16_pair(wh + r * K + k, &we, &wo);
            a[r][0] += xe * we;
            a[r][1] += xo * wo;
        }
    }
    for (int r = 0; r < R; r++) {
        float s = hsumv(a[r][0] + a[r][1]);
        for (int64_t j = k; j < K; j++) s += x[j] * bf16_to_f32(wh[r * K + j]);
        out[n + r] = s + (L->bias ? L->bias[n + r] : 0.f);
    }
}

/* M1_ROWS bf16 rows from n in the order `order` (as dense_rows_m1). */
INLINE void bf16_rows_m1(float *out, const float *x, const float *xs, const Layer *L, int64_t n, int order) {
    if (order == M1_ONE)
        for (int r = 0; r < M1_ROWS; r++) bf16_row_m1(out, x, xs, L, n + r);
    else if (order == M1_PAIRS)
        for (int r = 0; r < M1_ROWS; r += 2) bf16_pass_m1(out, x, xs, L, n + r, 2);
    else
        bf16_pass_m1(out, x, xs, L, n, M1_ROWS);
}

INLINE void bf16_row_m1(float *out, const float *x, const float *xs, const Layer *L, int64_t n) {
    const int64_t K = L->K;
    const uint16_t *wh = (const uint16_t *)L->w + n * K;
    vf a[4] = {{0}};
    int64_t k = 0;
    for (; k + 4 * VL <= K; k += 4 * VL)
        for (int i = 0; i < 2; i++) {
            vf we, wo;
            if (VL == 16 || i == 0) PREFETCH_L2(wh + k + 2 * i * VL, L->pf);
            ld_bf16_pair(wh + k + 2 * i * VL, &we, &wo);
            a[2 * i] += ldv(xs + k + 2 * i * VL) * we;
            a[2 * i + 1] += ldv(xs + k + 2 * i * VL + VL) * wo;
        }
    for (; k + 2 * VL <= K; k += 2 * VL) {
        vf we, wo;
        ld_bf16_pair(wh + k, &we, &wo);
        a[0] += ldv(xs + k) * we;
        a[1] += ldv(xs + k + VL) * wo;
    }
    float s = hsumv((a[0] + a[1]) + (a[2] + a[3]));
    for (int64_t j = k; j < K; j++) s += x[j] * bf16_to_f32(wh[j]);
    out[n] = s + (L->bias ? L->bias[n] : 0.f);
}

#endif
