/*
 * Memory bandwidth probe: read a large float buffer once with N threads, in one of two patterns (the caller times
 * both: which streams faster depends on the machine, as for the one-token GEMV rows, csrc/gemv_m1.h):
 * - interleaved: each thread streams the 2 MiB chunks it takes as four rows side by side, as the GEMVs' passes of
 *   several rows read their weights;
 * - sequential: each thread one stream over its own contiguous range (csrc/gemv_rows.h's queue), as the rows read
 *   one by one. On a 2-vCPU Zen 4 EPYC this read 30.2 GB/s where the interleaved one read 23.8 (alternating passes
 *   over 1 GiB in huge pages), and decodes had streamed up to 37 while the probe reported 28.
 * 8 independent vector accumulators either way (enough loads in flight to saturate the memory controllers; a single
 * accumulator chain measures the adder's latency instead).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "gemv_rows.h" /* take_rows, row_queue_t */
#include "simd_width.h"

#define ROW 2048
#define CHUNK 64 /* groups of 4 rows a chunk: 2 MiB */

static double read_sequential(const float *buf, int64_t n, int num_threads) {
    double total = 0.0;
    const int64_t rows = n / ROW;
    row_queue_t q;
    rq_init(&q, rows, num_threads, 1, ROW * 4);
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
        int64_t r0, r1;
        while (rq_take(&q, &r0, &r1))
            for (const float *p = buf + r0 * ROW, *e = buf + r1 * ROW; p < e; p += 8 * VL) {
                a0 += ldv(p), a1 += ldv(p + VL), a2 += ldv(p + 2 * VL), a3 += ldv(p + 3 * VL);
                a4 += ldv(p + 4 * VL), a5 += ldv(p + 5 * VL), a6 += ldv(p + 6 * VL), a7 += ldv(p + 7 * VL);
            }
        vf s = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
        for (int i = 0; i < VL; i++) total += s[i];
    }
    for (int64_t i = rows * ROW; i < n; i++) total += buf[i];
    return total;
}

/* The sum of buf's n floats, read by num_threads threads in the sequential pattern or the interleaved one. */
double stream_read_f32(const float *buf, int64_t n, int num_threads, int sequential) {
    if (sequential) return read_sequential(buf, n, num_threads);
    double total = 0.0;
    const int64_t groups = n / (4 * ROW);
    int64_t next = 0; /* the next chunk's first group */
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        /* Four streams per thread, read as the decode GEMVs read their weights: rows of ROW floats, four side by side.
         * One stream per core read 15-25 GB/s on a 2-core EPYC where those GEMVs streamed 28-42 from the same buffer;
         * this reads 28-30. Chunks of CHUNK groups (2 MiB) go to whichever thread asks, as the decode's rows do
         * (csrc/gemv_rows.h): with fixed halves a pass lasted as long as the slower vCPU's half, and the probe read
         * less than llama.cpp's and our decodes streamed (104-109% of it on a Zen 4 EPYC). */
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
        int64_t g0, g1;
        while (take_rows(&next, groups, CHUNK, &g0, &g1)) {
            for (int64_t g = g0; g < g1; g++) {
                const float *p = buf + g * 4 * ROW;
                for (int64_t k = 0; k < ROW; k += 2 * VL) {
                    a0 += ldv(p + k), a1 += ldv(p + k + VL), a2 += ldv(p + ROW + k), a3 += ldv(p + ROW + k + VL);
                    a4 += ldv(p + 2 * ROW + k), a5 += ldv(p + 2 * ROW + k + VL);
                    a6 += ldv(p + 3 * ROW + k), a7 += ldv(p + 3 * ROW + k + VL);
                }
            }
        }
        vf s = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
        for (int i = 0; i < VL; i++) total += s[i];
    }
    for (int64_t i = groups * (4 * ROW); i < n; i++) total += buf[i];
    return total;
}
