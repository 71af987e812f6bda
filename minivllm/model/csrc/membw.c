/*
 * Memory bandwidth probe: read a large float buffer once with N threads, each streaming its own
 * share in four streams with 8 independent vector accumulators (enough loads in flight to saturate the
 * memory controllers; a single accumulator chain measures the adder's latency instead).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* The machine's own vector width: an array of 64-byte vectors on AVX2 (two registers each) was kept in memory by
 * GCC, and the probe read 20 GB/s where llama.cpp's decode streamed 28 (2-core AVX2 EPYC). */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(VL * 4)));

double stream_read_f32(const float *buf, int64_t n, int num_threads) {
    double total = 0.0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* Four streams per thread (quarters of its share, read side by side): one stream per core read 20-25 GB/s
         * on a 2-core EPYC where GEMVs walking four weight rows at once streamed 31-35. */
        int64_t chunks = n / (4 * VL) / 4; /* 4 VL floats per stream per step */
        int64_t c0 = chunks * t / nt, c1 = chunks * (t + 1) / nt;
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
        const float *q0 = buf, *q1 = buf + chunks * 4 * VL, *q2 = q1 + chunks * 4 * VL, *q3 = q2 + chunks * 4 * VL;
        for (int64_t c = c0; c < c1; c++) {
            vf v[4][2];
            memcpy(v[0], q0 + c * 4 * VL, sizeof v[0]);
            memcpy(v[1], q1 + c * 4 * VL, sizeof v[1]);
            memcpy(v[2], q2 + c * 4 * VL, sizeof v[2]);
            memcpy(v[3], q3 + c * 4 * VL, sizeof v[3]);
            a0 += v[0][0], a1 += v[0][1], a2 += v[1][0], a3 += v[1][1];
            a4 += v[2][0], a5 += v[2][1], a6 += v[3][0], a7 += v[3][1];
            vf u[4][2];
            memcpy(u[0], q0 + c * 4 * VL + 2 * VL, sizeof u[0]);
            memcpy(u[1], q1 + c * 4 * VL + 2 * VL, sizeof u[1]);
            memcpy(u[2], q2 + c * 4 * VL + 2 * VL, sizeof u[2]);
            memcpy(u[3], q3 + c * 4 * VL + 2 * VL, sizeof u[3]);
            a0 += u[0][0], a1 += u[0][1], a2 += u[1][0], a3 += u[1][1];
            a4 += u[2][0], a5 += u[2][1], a6 += u[3][0], a7 += u[3][1];
        }
        vf s = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
        for (int i = 0; i < VL; i++) total += s[i];
    }
    for (int64_t i = n / (16 * VL) * (16 * VL); i < n; i++) total += buf[i];
    return total;
}
