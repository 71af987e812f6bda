/* Shared by the GEMV kernels (csrc/gemv.c, csrc/gemv_w4a8.c, csrc/gemv_q8.c, csrc/gemm_a8.c) and the bandwidth
 * probe (csrc/membw.c: take_rows); the includer includes <omp.h> and <stdint.h> and, for the row macros, defines MB
 * (rows of x per register block, 4). */
#ifndef MINIVLLM_GEMV_ROWS_H
#define MINIVLLM_GEMV_ROWS_H

/* How the one-token rows stream (csrc/gemv_m1.h): M1_ROWS rows a pass, one by one, or two a pass whose loads
 * alternate line by line; csrc/gemv.c holds the setting (model/row_order.py sets it at start-up), which the float,
 * W8A8 and GGUF block kernels read once a call. */
enum { M1_PASS = 0, M1_ONE = 1, M1_PAIRS = 2 };
extern int gemv_m1_order;

/* Bytes ahead of each load the one-token float and W8A8 rows prefetch into L2 (0: none; csrc/gemv.c holds it,
 * model/row_order.py times it at start-up with the order). */
extern int64_t gemv_m1_prefetch;

/* The line at p + ahead on its way to L2 (prefetcht1 on x86), where ahead > 0. */
#define PREFETCH_L2(p, ahead)                                                         \
    do {                                                                              \
        if (ahead) __builtin_prefetch((const char *)(p) + (ahead), 0, 2);             \
    } while (0)

/* Group scales and mins live in arrays of their own beside the packed codes, so the codes' prefetch does not bring
 * them, and the hardware's prefetcher did not either where rows go by in passes: each pass's first scale window and
 * its closing min term waited on memory. Same-process A/B on a Zen 5 EPYC (a 1B-shaped chain of one-token
 * projections, 8 layers' distinct weights, groups of 32, 2 threads, the memory streaming 75 GB/s): int4's rows
 * 18.9 -> 39.7 GB/s, W4A8's 34.9 -> 38.6 with the pass two on prefetched (one pass on 38.9 / 38.0, four 39.1 /
 * 37.4); one by one (long rows) int4 28.8 -> 34.9, W4A8 35.9 -> 36.3. Q8_0 blocks' rows one by one read the same
 * with or without (41.8 / 42.0 GB/s): not taken there. */
/* Prefetch (into L1) the scales (16-bit) and mins (mins_bytes each; NULL: none stored) of the `rows` weight rows from
 * row0, ng groups a row: the span as lines. */
static inline __attribute__((always_inline)) void prefetch_groups(const void *scale, const void *mins, int64_t row0,
                                                                  int64_t rows, int64_t ng, int mins_bytes) {
    const char *s = (const char *)scale + row0 * ng * 2, *end = s + rows * ng * 2;
    for (const char *p = (const char *)((uintptr_t)s & ~(uintptr_t)63); p < end; p += 64) __builtin_prefetch(p);
    if (mins) {
        const char *m = (const char *)mins + row0 * ng * mins_bytes, *mend = m + rows * ng * mins_bytes;
        for (const char *p = (const char *)((uintptr_t)m & ~(uintptr_t)63); p < mend; p += 64) __builtin_prefetch(p);
    }
}

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

/* FOR_ROWS with the rows as the queue q hands them out (rq_take, below; rq_init before the region). */
#define FOR_ROW_CHUNKS(mm, ROW, q)                                                    \
    do {                                                                              \
        int64_t c0_, c1_;                                                             \
        while (rq_take((q), &c0_, &c1_))                                              \
            for (int64_t n = c0_; n < c1_; n++)                                       \
                ROW_AGAINST_X(mm, ROW);                                               \
    } while (0)

/* One token's rows two a pass as the queue q hands them out (rq_init with unit 2 before the region): PAIR(n) for
 * rows n and n + 1, ONE(n) for a piece's odd last row (the GGUF block kernels' pairs, gemv_m1_order M1_PAIRS). */
#define FOR_ROW_PAIRS(PAIR, ONE, q)                                                   \
    do {                                                                              \
        int64_t n_, e_;                                                               \
        while (rq_take((q), &n_, &e_)) {                                              \
            for (; n_ + 2 <= e_; n_ += 2) PAIR(n_);                                   \
            if (n_ < e_) ONE(n_);                                                     \
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

/* A weight matrix's rows shared among the threads of a parallel region: each thread starts on its own contiguous
 * range (1/nt of the rows) and takes it piece by piece from the front; once it is empty, it takes half of what
 * another thread has left, from the back. Fixed shares left the faster vCPU waiting at the region's end (the two
 * vCPUs of these VMs stream memory at different speeds from one moment to the next; libgomp's spin was 11% of a
 * 2-thread MoE decode's samples); chunks of ~512 KiB handed to whichever thread asks (the scheme before this one)
 * balanced them but made each thread jump to a new address range per chunk, and each jump costs the stream's
 * run-up: at a 135M model's projections (4 chunks of 47-221 KiB) 6 chunks a thread instead of 2 made the decode
 * stack 0.83x, 1 a thread 1.00-1.09x. Taking pieces from the front keeps a thread's stream contiguous however small
 * the pieces (the pieces only bound the end's imbalance), and a thread jumps only to steal. Same-process A/B on a
 * Zen 4 EPYC (2 threads, the whole one-token decode stack of GGUF Q4_0 files, against 512 KiB chunks): 135M
 * 1.02-1.08x, 1B 1.06x; libgomp's spin 19% -> 15% of the samples.
 * rq_init (before the region, with the thread count asked for: a thread the region does not get leaves its range
 * to the others' stealing) splits rows [0, N) (N < 2^31) at multiples of `unit` (the kernel's rows per pass), so
 * only a range ending at N has a tail; pieces are ~RQ_PIECE bytes of weights (row_bytes a row). rq_take returns 0
 * when no rows are left, else sets [*n, *end). */
#define RQ_MAX_THREADS 64
#define RQ_PIECE (64 << 10)
typedef struct {
    uint64_t range[RQ_MAX_THREADS * 8]; /* thread t's [lo, hi), lo | hi << 32, at range[8 t]: a cache line each */
    int nt;
    int64_t piece, unit;
} row_queue_t;

static inline uint64_t rq_pack(int64_t lo, int64_t hi) { return (uint64_t)lo | ((uint64_t)hi << 32); }

static inline void rq_init(row_queue_t *q, int64_t N, int nt, int64_t unit, int64_t row_bytes) {
    nt = nt < 1 ? 1 : nt > RQ_MAX_THREADS ? RQ_MAX_THREADS : nt;
    int64_t piece = RQ_PIECE / (row_bytes > 0 ? row_bytes : 1) / unit * unit;
    q->nt = nt, q->unit = unit, q->piece = piece < unit ? unit : piece;
    for (int t = 0; t < nt; t++) {
        const int64_t lo = N * t / nt / unit * unit, hi = t + 1 == nt ? N : N * (t + 1) / nt / unit * unit;
        q->range[8 * t] = rq_pack(lo, hi);
    }
}

static inline int rq_take(row_queue_t *q, int64_t *n, int64_t *end) {
    const int me = omp_get_thread_num() % q->nt;
    for (int d = 0; d < q->nt; d++) {
        uint64_t *r = q->range + 8 * ((me + d) % q->nt), v = __atomic_load_n(r, __ATOMIC_RELAXED);
        for (;;) {
            const int64_t lo = (int64_t)(v & 0xffffffffu), hi = (int64_t)(v >> 32);
            if (lo >= hi) break;
            int64_t a = lo, b = lo + q->piece < hi ? lo + q->piece : hi; /* its own: the next piece */
            if (d) { /* another's: the back half (all of a last piece) */
                a = hi - lo <= q->piece ? lo : lo + ((hi - lo) / 2 + q->unit - 1) / q->unit * q->unit;
                b = hi;
            }
            if (__atomic_compare_exchange_n(r, &v, d ? rq_pack(lo, a) : rq_pack(b, hi), 0, __ATOMIC_RELAXED,
                                            __ATOMIC_RELAXED)) {
                *n = a, *end = b;
                return 1;
            }
        }
    }
    return 0;
}

/* A piece [*at, end) of k projections' rows laid end to end, each padded to Np rows (a whole number of the kernel's
 * passes, so a projection's rows fall into passes as they would alone): its next span inside one projection, as
 * that projection *j and its rows [*n, *n_end) (none past N), *at moved past it; 0 once the piece is done. */
static inline int rq_span(int64_t *at, int64_t end, int64_t Np, int64_t N, int *j, int64_t *n, int64_t *n_end) {
    if (*at >= end) return 0;
    *j = (int)(*at / Np);
    const int64_t base = *j * Np;
    *n = *at - base;
    *n_end = end - base < N ? end - base : N;
    *at = base + Np < end ? base + Np : end;
    return 1;
}

/* Chunks of `chunk` items to whichever thread asks (the bandwidth probe's 2 MiB chunks, the tiles' panels). */
static inline int take_rows(int64_t *next, int64_t N, int64_t chunk, int64_t *n, int64_t *end) {
    *n = __atomic_fetch_add(next, chunk, __ATOMIC_RELAXED);
    *end = *n + chunk < N ? *n + chunk : N;
    return *n < N;
}

#endif
