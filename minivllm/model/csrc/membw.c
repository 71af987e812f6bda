/*
 * Memory bandwidth probe: read a large float buffer once with N threads, each streaming its own
 * contiguous share with 8 independent vector accumulators (enough loads in flight to saturate the
 * memory controllers; a single accumulator chain measures the adder's latency instead).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

double stream_read_f32(const float *buf, int64_t n, int num_threads) {
    double total = 0.0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t chunks = n / 128;
        int64_t c0 = chunks * t / nt, c1 = chunks * (t + 1) / nt;
        v16 acc[8] = {0};
        for (int64_t c = c0; c < c1; c++) {
            const float *p = buf + c * 128;
            for (int j = 0; j < 8; j++) {
                v16 v;
                memcpy(&v, p + 16 * j, sizeof v);
                acc[j] += v;
            }
        }
        v16 s = acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
        for (int i = 0; i < 16; i++) total += s[i];
    }
    for (int64_t i = n / 128 * 128; i < n; i++) total += buf[i];
    return total;
}
