/* Shared by the GEMV kernels (csrc/gemv.c, csrc/gemv_w4a8.c, csrc/gemv_q8.c, csrc/gemm_a8.c) and the bandwidth
 * probe (csrc/membw.c: take_rows); the includer includes <omp.h> and, for the row macros, defines MB (rows of x
 * per register block, 4). */
#ifndef MINIVLLM_GEMV_ROWS_H
#define MINIVLLM_GEMV_ROWS_H

/* Weight row n against the rows of x in chunks of up to MB; ROW(c) is called with c a literal so each chunk size
 * gets its own register-resident code. */
#define ROW_AGAINST_X(mm, ROW)                                                        \
    do {                                                                              \
        for (int j = 0; j < (mm); j += MB) {                                          \
            switch ((mm) - j < MB ? (mm) - j : MB) {                                  \
            case 1: ROW(1); break;                                                    \
            case 2: ROW(2); break;                                                    \
            case 3: ROW(3); break;                                                    \
            default: ROW(4); break;                                                   \
            }                                                                         \
        }                                                                             \
    } while (0)

/* Every row of this thread's share of N (ROW_AGAINST_X each). */
#define FOR_ROWS(N, mm, ROW)                                                          \
    do {                                                                              \
        int t_ = omp_get_thread_num(), nt_ = omp_get_num_threads();                   \
        for (int64_t n = (N) * t_ / nt_; n < (N) * (t_ + 1) / nt_; n++)               \
            ROW_AGAINST_X(mm, ROW);                                                   \
    } while (0)

/* FOR_ROWS with the rows in chunks to whichever thread asks (take_rows, below; *next starts at 0, row_bytes: a
 * weight row's bytes). */
#define FOR_ROW_CHUNKS(N, mm, ROW, next, row_bytes)                                   \
    do {                                                                              \
        const int64_t chunk_ = row_chunk((N), omp_get_num_threads(), 1, (row_bytes)); \
        int64_t c0_, c1_;                                                             \
        while (take_rows((next), (N), chunk_, &c0_, &c1_))                            \
            for (int64_t n = c0_; n < c1_; n++)                                       \
                ROW_AGAINST_X(mm, ROW);                                               \
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

/* One token's rows handed out in chunks to whichever thread of the enclosing parallel region asks first, not in
 * fixed shares: the two vCPUs of these VMs stream memory at different speeds from one moment to the next (noisy
 * neighbours), so a fixed split left the faster thread waiting at the region's end (libgomp's spin was 11% of a
 * 2-thread MoE decode's samples). About 512 KiB of weights a chunk: smaller ones cost the one-token W4A8 rows their
 * streams' run-up (64 rows of 1 KiB: 0.93x fixed shares, 256-1024 rows: 0.99-1.03x, 512 KiB 1.05x), larger ones
 * leave less to balance; a multiple of `unit` (the kernel's rows per pass) so only the last has a tail, and at
 * least two a thread. *next starts at 0; take_rows returns 0 when none are left, else sets [*n, *end). */
static inline int64_t row_chunk(int64_t N, int nt, int64_t unit, int64_t row_bytes) {
    int64_t c = ((int64_t)512 << 10) / (row_bytes > 0 ? row_bytes : 1);
    if (c > N / (2 * (int64_t)nt)) c = N / (2 * (int64_t)nt);
    c = c / unit * unit;
    return c < unit ? unit : c;
}

static inline int take_rows(int64_t *next, int64_t N, int64_t chunk, int64_t *n, int64_t *end) {
    *n = __atomic_fetch_add(next, chunk, __ATOMIC_RELAXED);
    *end = *n + chunk < N ? *n + chunk : N;
    return *n < N;
}

#endif
