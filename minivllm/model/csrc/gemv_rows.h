/* Shared by the GEMV kernels (csrc/gemv.c, csrc/gemv_q8.c); the includer defines MB (rows of x per register
 * block, 4) and includes <omp.h>. */
#ifndef MINIVLLM_GEMV_ROWS_H
#define MINIVLLM_GEMV_ROWS_H

/* Every row of this thread's share of N against chunks of up to MB rows of x; ROW(c) is called with c
 * a literal so each chunk size gets its own register-resident code. */
#define FOR_ROWS(N, mm, ROW)                                                          \
    do {                                                                              \
        int t_ = omp_get_thread_num(), nt_ = omp_get_num_threads();                   \
        for (int64_t n = (N) * t_ / nt_; n < (N) * (t_ + 1) / nt_; n++) {             \
            for (int j = 0; j < (mm); j += MB) {                                      \
                switch ((mm) - j < MB ? (mm) - j : MB) {                              \
                case 1: ROW(1); break;                                                \
                case 2: ROW(2); break;                                                \
                case 3: ROW(3); break;                                                \
                default: ROW(4); break;                                               \
                }                                                                     \
            }                                                                         \
        }                                                                             \
    } while (0)

/* ROW(c) for a block of mt (1..8) tokens, c the literal mt: each size its own register-resident code (the AVX2
 * rows that take 8 tokens a pass). */
#define SWITCH_M8(mt, ROW)                                                            \
    do {                                                                              \
        switch (mt) {                                                                 \
        case 1: ROW(1); break;                                                        \
        case 2: ROW(2); break;                                                        \
        case 3: ROW(3); break;                                                        \
        case 4: ROW(4); break;                                                        \
        case 5: ROW(5); break;                                                        \
        case 6: ROW(6); break;                                                        \
        case 7: ROW(7); break;                                                        \
        default: ROW(8); break;                                                       \
        }                                                                             \
    } while (0)

#endif
