/*
 * Linear layers for a few tokens at a time (decode): y[M, N] = x[M, K] W^T (+ bias), reading each weight
 * once for all M rows of x. At small M these layers are a pass over the weights, bound by memory
 * bandwidth, so the weights stay in memory as compact as their format allows and are widened in
 * registers. x and y are float32.
 *
 * Weight formats (row n of W is output channel n):
 *   f32    w [N, K] float32
 *   bf16   w [N, K] bfloat16 bits
 *   int8   w [N, K] int8, per-channel scale s[n]:                 W[n, k] = s[n] * w[n, k]
 *   int4   (csrc/gemv_int4.c) w [N, Kp / 2] uint8, Kp = K rounded up to the group size G (a multiple of 32), per-group
 *          scale and min as bf16 [N, Kp / G]:                    W[n, k] = scale * q + min, q in 0..15;
 *          or as float16 (fmt | FMT_F16_SCALES), the mins as float32 (fmt | FMT_F32_MINS): GGUF's Q4_0 / Q4_1
 *          and GPTQ / AWQ / compressed-tensors checkpoints keep their scales (and -scale * zero) exactly so;
 *          | FMT_SYM_MINS: no mins stored, each is -8 * scale (Q4_0's blocks: 18 bytes per 32 weights, not 20).
 *          Each 32-weight block is 16 bytes; byte j holds q[j] (low nibble) and q[j + 16] (high
 *          nibble), so one 16-byte load widens to two 16-lane vectors without shuffles.
 *   w8a8   the int8 weights; x is quantized per row here (symmetric, absmax / 127, round half to
 *          even as torch.round): y[m, n] = xs[m] * s[n] * sum_k xq[m, k] w[n, k], exact in int32.
 *   w4a8   the int4 weights against x quantized as for w8a8 (csrc/gemv_w4a8.c; from 17 rows of x on, all rows at
 *          once as a tiled GEMM, csrc/gemm_a8.c); | FMT_ACT_BLOCKS (groups of 32): x quantized per 32-weight block
 *          instead, each its own scale (llama.cpp's Q8_0 activations).
 *   q8     w [N, Kp] int8 in blocks of 32, a float16 scale each (GGUF's Q8_0); q8a8 the same against int8 x
 *          (csrc/gemv_q8.c), | FMT_ACT_BLOCKS: x's blocks of 32 each their own scale.
 *   q6k    w [N, K / 256 * 210] uint8: GGUF's Q6_K superblocks as the file holds them (csrc/gemv_q6k.c; K a
 *          multiple of 256), weight-only, | FMT_ACT_BLOCKS: against x in blocks of 32.
 *   q4k    w [N, K / 256 * 144] uint8: GGUF's Q4_K superblocks as the file holds them (csrc/gemv_q4k.c), the same.
 *
 * Each thread walks its share of N one weight row at a time, with two accumulators per row of x so the FMA
 * chains overlap; at one token the float formats take four or eight weight rows per pass instead (each load of
 * x serving them all: 1.2-1.5x the one-row pass on an AVX2 EPYC, see dense_rows_m1; rows one by one where
 * or two a pass, where start-up timing finds that faster: gemv_m1_order), and the one-token paths
 * share rows out as csrc/gemv_rows.h's queue does (rq_take). Rows of x come in chunks of up to MB, each
 * chunk size compiled on its own so the accumulators live in registers. GCC vector extensions:
 * AVX-512 where the CPU has it, narrower registers elsewhere; only the byte-widening loads use
 * intrinsics (GCC 12 scalarises __builtin_convertvector from 8-bit lanes).
 */
#include "gemv_common.h"

int gemv_m1_order = 0; /* M1_PASS (see gemv_m1.h) until set_gemv_m1_order says otherwise */

void set_gemv_m1_order(int order) { __atomic_store_n(&gemv_m1_order, order, __ATOMIC_RELAXED); }

/* The order the one-token rows take now (M1_PASS and M1_PAIRS give the same bits: tests read it here). */
int gemv_m1_order_now(void) { return __atomic_load_n(&gemv_m1_order, __ATOMIC_RELAXED); }

/* 0 until set_gemv_m1_prefetch says otherwise. The hardware prefetcher alone left these rows' loads waiting on a
 * 2-vCPU Sapphire Rapids-class Xeon: a 1B model's one-token decode stack ran W8A8 1.12x and bf16 (dot-product rows)
 * 1.04x as fast with each 64 bytes' line 8 KiB / 4 KiB on requested into L2 (same process, alternating), f32 0.97-0.99x
 * (so each model's start-up timing decides; into L1 instead, W8A8 gained a third as much). Any value gives the same
 * bits. */
int64_t gemv_m1_prefetch = 0;

void set_gemv_m1_prefetch(int64_t bytes) { __atomic_store_n(&gemv_m1_prefetch, bytes, __ATOMIC_RELAXED); }

/* Float rows of at most this many weights (K) go one by one at 2..FEW_ROWS_MAX_M tokens (csrc/gemv_avx512.h's
 * dense_row1_avx512) rather than several a pass; 0 (never) until set_gemv_few_rows_k says otherwise
 * (model/row_order.py times it per row length at start-up). */
int64_t gemv_few_rows_k = 0;

void set_gemv_few_rows_k(int64_t k) { __atomic_store_n(&gemv_few_rows_k, k, __ATOMIC_RELAXED); }

/* Float weights (f32 or bf16) against M rows of x. */
INLINE void dense_row(float *out, int64_t ldo, const float *x, int M, const Layer *L, int bf16, int64_t n) {
    const int64_t K = L->K;
    v16 a0[MB], a1[MB];
    memset(a0, 0, sizeof a0);
    memset(a1, 0, sizeof a1);
    const float *wf = (const float *)L->w + n * K;
    const uint16_t *wh = (const uint16_t *)L->w + n * K;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        v16 w0 = bf16 ? ld16_bf16(wh + k) : ld16(wf + k), w1 = bf16 ? ld16_bf16(wh + k + 16) : ld16(wf + k + 16);
        for (int m = 0; m < M; m++) {
            a0[m] += ld16(x + m * L->Kv + k) * w0;
            a1[m] += ld16(x + m * L->Kv + k + 16) * w1;
        }
    }
    for (; k + 16 <= K; k += 16) {
        v16 w0 = bf16 ? ld16_bf16(wh + k) : ld16(wf + k);
        for (int m = 0; m < M; m++) a0[m] += ld16(x + m * L->Kv + k) * w0;
    }
    for (int m = 0; m < M; m++) {
        float s = hsum(a0[m] + a1[m]);
        for (int64_t j = k; j < K; j++) s += x[m * L->Kv + j] * (bf16 ? bf16_to_f32(wh[j]) : wf[j]);
        out[m * ldo + n] = s + (L->bias ? L->bias[n] : 0.f);
    }
}

INLINE void int8_row(float *out, int64_t ldo, const float *x, int M, const Layer *L, int64_t n) {
    const int64_t K = L->K;
    const int8_t *w = (const int8_t *)L->w + n * K;
    v16 a0[MB], a1[MB];
    memset(a0, 0, sizeof a0);
    memset(a1, 0, sizeof a1);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        v16 w0 = __builtin_convertvector(widen_s8(w + k), v16), w1 = __builtin_convertvector(widen_s8(w + k + 16), v16);
        for (int m = 0; m < M; m++) {
            a0[m] += ld16(x + m * L->Kv + k) * w0;
            a1[m] += ld16(x + m * L->Kv + k + 16) * w1;
        }
    }
    for (; k + 16 <= K; k += 16) {
        v16 w0 = __builtin_convertvector(widen_s8(w + k), v16);
        for (int m = 0; m < M; m++) a0[m] += ld16(x + m * L->Kv + k) * w0;
    }
    float sc = ((const float *)L->scale)[n];
    for (int m = 0; m < M; m++) {
        float s = hsum(a0[m] + a1[m]);
        for (int64_t j = k; j < K; j++) s += x[m * L->Kv + j] * (float)w[j];
        out[m * ldo + n] = s * sc + (L->bias ? L->bias[n] : 0.f);
    }
}

/* Whether the one-token int8 rows follow gemv_m1_order here (AVX-512 VNNI's: W8A8's per-channel rows, and GGUF's
 * Q8_0 / Q4_K / Q6_K rows against x in blocks, csrc/gemv_q8.c, gemv_q4k.c, gemv_q6k.c, built on the same condition):
 * where not, timing their layers each way would only measure noise. */
int gemv_w8a8_rows_ordered(void) {
#ifdef GEMV_W8A8_M1_VNNI
    return 1;
#else
    return 0;
#endif
}

/* Whether the few-token float rows follow gemv_few_rows_k here (AVX-512's rows; AVX2's and the generic ones do not). */
int gemv_few_rows_ordered(void) {
#ifdef GEMV_DENSE_AVX512
    return 1;
#else
    return 0;
#endif
}

/* x here is the int8 quantized rows (Kv bytes apart), xs their scales. With AVX512-VNNI, vpdpbusd sums
 * 64 byte products per instruction; it takes one unsigned operand, so x is shifted to x + 128 (a
 * sign-bit flip) and 128 * sum(w), summed by the same instruction against a vector of ones, is taken
 * off again: exact, like the widening path. */
INLINE void w8a8_row(float *out, int64_t ldo, const int8_t *xq, const float *xs, int M, const Layer *L, int64_t n) {
    const int64_t K = L->K;
    const int8_t *w = (const int8_t *)L->w + n * K;
    v16i acc[MB];
    memset(acc, 0, sizeof acc);
    int64_t k = 0, wsum = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const __m512i flip = _mm512_set1_epi8((char)0x80), ones = _mm512_set1_epi8(1);
    __m512i wacc = _mm512_setzero_si512();
    for (; k + 64 <= K; k += 64) {
        __m512i wv = _mm512_loadu_si512((const void *)(w + k));
        wacc = _mm512_dpbusd_epi32(wacc, ones, wv);
        for (int m = 0; m < M; m++) {
            __m512i xu = _mm512_xor_si512(_mm512_loadu_si512((const void *)(xq + m * L->Kv + k)), flip);
            acc[m] = (v16i)_mm512_dpbusd_epi32((__m512i)acc[m], xu, wv);
        }
    }
    wsum = _mm512_reduce_add_epi32(wacc);
#elif defined(__AVX2__)
    /* s8_dot32_acc (exact): 3-4x the widening loop. */
    __m256i acc8[MB];
    for (int m = 0; m < M; m++) acc8[m] = _mm256_setzero_si256();
    for (; k + 32 <= K; k += 32) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k)), wa = _mm256_sign_epi8(wv, wv);
        for (int m = 0; m < M; m++) acc8[m] = s8_dot32_acc(acc8[m], wa, wv, xq + m * L->Kv + k);
    }
    for (int m = 0; m < M; m++) {
        int32_t v[8];
        _mm256_storeu_si256((__m256i *)v, acc8[m]);
        for (int i = 0; i < 8; i++) acc[m][i] += v[i];
    }
#endif
    for (; k + 16 <= K; k += 16) {
        v16i wv = widen_s8(w + k);
        for (int m = 0; m < M; m++) acc[m] += widen_s8(xq + m * L->Kv + k) * wv;
    }
    float sc = ((const float *)L->scale)[n];
    for (int m = 0; m < M; m++) {
        int64_t s = -128 * wsum;
        for (int i = 0; i < 16; i++) s += acc[m][i];
        for (int64_t j = k; j < K; j++) s += (int32_t)xq[m * L->Kv + j] * w[j];
        out[m * ldo + n] = (float)s * xs[m] * sc + (L->bias ? L->bias[n] : 0.f);
    }
}

/* csrc/quantize_rows.c: one row of x as int8 codes (absmax / 127, round half to even); returns the scale */
float quantize_row_s8(const float *xr, int64_t K, int8_t *xq);

/* csrc/gemv_w4a8.c */
void gemv_w4a8(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
               const void *scale, const void *mins, int64_t G, int halves, const float *bias, float *scratch,
               int num_threads);
int gemv_w4a8_m1_many(float *out, int64_t ldo, const float *x, int64_t ldx, int k, int64_t K, int64_t N,
                      const void *const *w, const void *const *scale, const void *const *mins, int64_t G, int halves,
                      const float *const *bias, float *scratch, int num_threads);
/* csrc/gemm_a8.c: W4A8 and q8a8 at many tokens, all rows at once (0 where it has no path) */
int gemm_w4a8(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
              const void *scale, const void *mins, int64_t G, int halves, const float *bias, int num_threads);
int gemm_q8a8(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
              const void *scale, const float *bias, int ablk, int num_threads);
int gemm_q6k(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
             const float *bias, int num_threads);
int gemm_q4k(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
             const float *bias, int num_threads);
/* Q6_K's rows convert and scale every 64 codes for each row of x, its tiles (two conversions a block) every 16 weight
 * rows: the 1B head (128256 x 2048, a Zen 4 EPYC, 2 threads) ran 8 / 12 / 16 rows of x in ~20 / ~30 / 40.7 ms as
 * rows, 26.0 / 30.1 / 33.4 as tiles. */
#define Q6K_GEMM_MIN_M 12
/* Q4_K's: the tiles' speed over the rows' on a 1B layer's four shapes (Zen 4 EPYC, 2 threads, 7 interleaved rounds)
 * 0.90 / 1.03 / 1.09 at 12 / 14 / 16 rows of x */
#define Q4K_GEMM_MIN_M 14
#ifndef GEMM_A8_MIN_M /* below it the rows win: the tiles' repacking costs as much as 2-8 rows of x (1B shapes) */
#define GEMM_A8_MIN_M 17
#endif
/* csrc/gemv_q8.c: int8 weights in blocks of 32 with float16 scales (GGUF's Q8_0), weight-only or a8 */
void gemv_q8(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
             const void *scale, const float *bias, int a8, float *scratch, int num_threads);

/* csrc/gemv_q6k.c: GGUF's Q6_K superblocks, weight-only or against x in blocks of 32 (a8) */
void gemv_q6k(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
              const float *bias, int a8, float *scratch, int num_threads);
/* csrc/gemv_q4k.c: GGUF's Q4_K superblocks, the same */
void gemv_q4k(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, const void *w,
              const float *bias, int a8, float *scratch, int num_threads);

/*
 * y = x W^T + bias for one of the formats above.
 *   out [M, N] rows ldo floats apart; x [M, K] rows ldx floats apart (unit column stride)
 *   fmt: FMT_*; int4 and w4a8 | FMT_F16_SCALES for float16 scales (and mins), | FMT_F32_MINS for float32 mins
 *   w, scale, mins, G as the format says (unused ones may be NULL / 0)
 *   scratch: float32, >= MAX_M * (Kp + 2 Kp / G + 64) floats (staged, padded or quantized rows of x)
 */
void linear_gemv(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, int64_t N, int fmt,
                 const void *w, const void *scale, const void *mins, int64_t G, const float *bias, float *scratch,
                 int num_threads) {
    /* bit 0: f16 scales, bit 1: f32 mins, bit 2: no mins (-8 scale), bit 3: w4a8's x in blocks of 32 */
    const int halves = (fmt & (FMT_F16_SCALES | FMT_F32_MINS | FMT_SYM_MINS | FMT_ACT_BLOCKS)) / FMT_F16_SCALES;
    fmt &= ~(FMT_F16_SCALES | FMT_F32_MINS | FMT_SYM_MINS | FMT_ACT_BLOCKS);
    Layer L = {.w = w, .K = K, .Kv = ldx, .scale = scale, .mins = mins, .G = G, .bias = bias, .f16 = halves & 1,
               .pf = M == 1 ? __atomic_load_n(&gemv_m1_prefetch, __ATOMIC_RELAXED) : 0,
               .f32mins = (halves >> 1) & 1, .sym = (halves >> 2) & 1, .M = M};
    if (fmt == FMT_W4A8 && M >= GEMM_A8_MIN_M &&
        gemm_w4a8(out, ldo, x, ldx, M, K, N, w, scale, mins, G, halves, bias, num_threads))
        return;
    if (fmt == FMT_Q8A8 && M >= GEMM_A8_MIN_M &&
        gemm_q8a8(out, ldo, x, ldx, M, K, N, w, scale, bias, (halves >> 3) & 1, num_threads))
        return;
    if (fmt == FMT_Q6K && (halves >> 3) & 1 && M >= Q6K_GEMM_MIN_M &&
        gemm_q6k(out, ldo, x, ldx, M, K, N, w, bias, num_threads))
        return;
    if (fmt == FMT_Q4K && (halves >> 3) & 1 && M >= Q4K_GEMM_MIN_M &&
        gemm_q4k(out, ldo, x, ldx, M, K, N, w, bias, num_threads))
        return;
    for (int m0 = 0; m0 < M; m0 += MAX_M) {
        int mm = M - m0 < MAX_M ? M - m0 : MAX_M;
        const float *xm = x + m0 * ldx;
        float *o = out + m0 * ldo;
        if (fmt == FMT_Q6K) {
            gemv_q6k(o, ldo, xm, ldx, mm, K, N, w, bias, (halves >> 3) & 1, scratch, num_threads);
        } else if (fmt == FMT_Q4K) {
            gemv_q4k(o, ldo, xm, ldx, mm, K, N, w, bias, (halves >> 3) & 1, scratch, num_threads);
        } else if (fmt == FMT_Q8 || fmt == FMT_Q8A8) {
            const int a8 = fmt == FMT_Q8A8 ? 1 + ((halves >> 3) & 1) : 0; /* 2: x in blocks of 32 */
            gemv_q8(o, ldo, xm, ldx, mm, K, N, w, scale, bias, a8, scratch, num_threads);
        } else if (fmt == FMT_W4A8) {
            gemv_w4a8(o, ldo, xm, ldx, mm, K, N, w, scale, mins, G, halves, bias, scratch, num_threads);
        } else if (fmt == FMT_INT4) {
            gemv_int4(o, ldo, xm, ldx, mm, N, &L, scratch, num_threads);
        } else if (fmt == FMT_W8A8) {
            float *xs = scratch;
            int8_t *xq = (int8_t *)(scratch + MAX_M);
            for (int m = 0; m < mm; m++) xs[m] = quantize_row_s8(xm + m * ldx, K, xq + m * K);
            L.Kv = K;
#ifdef GEMV_W8A8_M1_VNNI
            if (mm == 1) {
                int32_t xsum = 0;
                for (int64_t k = 0; k < K; k++) xsum += xq[k];
                row_queue_t q;
                rq_init(&q, N, num_threads, 4, K);
                const int order = __atomic_load_n(&gemv_m1_order, __ATOMIC_RELAXED);
#pragma omp parallel num_threads(num_threads)
                w8a8_m1_vnni(o, xq, xs[0], xsum, &L, &q, order);
                continue;
            }
#endif
#ifdef GEMV_AVX2
#pragma omp parallel num_threads(num_threads)
            w8a8_rows_avx2(o, ldo, xq, xs, mm, &L, N);
#else
#define RW(c) w8a8_row(o + j * ldo, ldo, xq + j * K, xs + j, c, &L, n)
#pragma omp parallel num_threads(num_threads)
            FOR_ROWS(N, mm, RW);
#endif
        } else if (fmt == FMT_INT8) {
#ifdef GEMV_AVX2
#define R8(c) int8_row_avx2(o + j * ldo, ldo, xm + j * ldx, c, &L, n)
#else
#define R8(c) int8_row(o + j * ldo, ldo, xm + j * ldx, c, &L, n)
#endif
#pragma omp parallel num_threads(num_threads)
            FOR_ROWS(N, mm, R8);
        } else if (mm == 1) {
            const int bf16 = fmt == FMT_BF16;
            const int dot = bf16 && bf16_exact(xm, K); /* (x a bf16 model's: vdpbf16ps, gemv_bf16dot.h) */
            if (dot) bf16_pack_x((uint16_t *)scratch, xm, K);
            else if (bf16) bf16_split_x(scratch, xm, K);
            row_queue_t q;
            rq_init(&q, N, num_threads, M1_ROWS, K * (bf16 ? 2 : 4));
            const int order = __atomic_load_n(&gemv_m1_order, __ATOMIC_RELAXED);
#pragma omp parallel num_threads(num_threads)
            {
                int64_t n, end;
                while (rq_take(&q, &n, &end)) {
                    for (; n + M1_ROWS <= end; n += M1_ROWS) {
                        if (dot) bf16dot_rows(o, (const uint16_t *)scratch, &L, n, order);
                        else if (bf16) bf16_rows_m1(o, xm, scratch, &L, n, order);
                        else dense_rows_m1(o, xm, &L, n, order);
                    }
                    for (; n < end; n++) {
                        if (dot) bf16dot_row(o, (const uint16_t *)scratch, &L, n);
                        else if (bf16) bf16_row_m1(o, xm, scratch, &L, n);
                        else dense_row_m1(o, xm, &L, n);
                    }
                }
            }
        } else if (fmt == FMT_BF16) {
#if defined(GEMV_DENSE_AVX512)
            row_queue_t q;
            rq_init(&q, N, num_threads, 8, K * 2);
            const int one = mm <= FEW_ROWS_MAX_M && K <= __atomic_load_n(&gemv_few_rows_k, __ATOMIC_RELAXED);
#pragma omp parallel num_threads(num_threads)
            dense_all_avx512(o, ldo, xm, mm, &L, 1, &q, one);
#elif defined(GEMV_AVX2)
#pragma omp parallel num_threads(num_threads)
            dense_all_avx2(o, ldo, xm, mm, &L, 1, N);
#else
#define RB(c) dense_row(o + j * ldo, ldo, xm + j * ldx, c, &L, 1, n)
#pragma omp parallel num_threads(num_threads)
            FOR_ROWS(N, mm, RB);
#endif
        } else {
#if defined(GEMV_DENSE_AVX512)
            row_queue_t q;
            rq_init(&q, N, num_threads, 8, K * 4);
            const int one = mm <= FEW_ROWS_MAX_M && K <= __atomic_load_n(&gemv_few_rows_k, __ATOMIC_RELAXED);
#pragma omp parallel num_threads(num_threads)
            dense_all_avx512(o, ldo, xm, mm, &L, 0, &q, one);
#elif defined(GEMV_AVX2)
#pragma omp parallel num_threads(num_threads)
            dense_all_avx2(o, ldo, xm, mm, &L, 0, N);
#else
#define RF(c) dense_row(o + j * ldo, ldo, xm + j * ldx, c, &L, 0, n)
#pragma omp parallel num_threads(num_threads)
            FOR_ROWS(N, mm, RF);
#endif
        }
    }
}

/* k float32 projections at one token each in one region (linear_gemv_m1_many, below): each row computed as
 * linear_gemv's one-token f32 path computes it (dense_rows_m1 / dense_row_m1), the k projections' rows shared out
 * as one range (csrc/gemv_rows.h's queue). */
static int dense_m1_many(float *out, int64_t ldo, const float *x, int64_t ldx, int k, int64_t K, int64_t N,
                         const void *const *w, const float *const *bias, int num_threads) {
    if (k < 1 || k > 16) return 0;
    Layer L[16];
    const int64_t pf = __atomic_load_n(&gemv_m1_prefetch, __ATOMIC_RELAXED);
    for (int j = 0; j < k; j++) L[j] = (Layer){.w = w[j], .K = K, .Kv = K, .bias = bias ? bias[j] : NULL, .pf = pf};
    /* The k projections' rows as one range, each projection's padded to whole passes (Np rows, those past N
     * skipped) so its rows fall into passes as linear_gemv's one projection does (equal bits). */
    const int64_t Np = (N + M1_ROWS - 1) / M1_ROWS * M1_ROWS;
    row_queue_t q;
    rq_init(&q, Np * k, num_threads, M1_ROWS, K * 4);
    const int order = __atomic_load_n(&gemv_m1_order, __ATOMIC_RELAXED);
#pragma omp parallel num_threads(num_threads)
    {
        int64_t at, c_end, n, end;
        int j;
        while (rq_take(&q, &at, &c_end))
        while (rq_span(&at, c_end, Np, N, &j, &n, &end)) { /* (a piece may run from one projection into the next) */
            const float *xj = x + j * ldx;
            float *o = out + j * ldo;
            for (; n + M1_ROWS <= end; n += M1_ROWS) dense_rows_m1(o, xj, &L[j], n, order);
            for (; n < end; n++) dense_row_m1(o, xj, &L[j], n);
        }
    }
    return 1;
}

/*
 * k projections of one shape and format at one token each (w, scale, mins, bias: k pointers each; bias may be NULL)
 * in one parallel region: out + j ldo = (x + j ldx) W_j^T + b_j, ldx 0 for one x shared by all. A mixture's chosen
 * experts at one decoding token (csrc/moe_decode.c): three regions a layer instead of five, the second thread
 * waiting at each end. W4A8 (with VNNI) and float32; returns 0 where the format has no such path: the caller runs
 * them one by one.
 */
int linear_gemv_m1_many(float *out, int64_t ldo, const float *x, int64_t ldx, int k, int64_t K, int64_t N, int fmt,
                        const void *const *w, const void *const *scale, const void *const *mins, int64_t G,
                        const float *const *bias, float *scratch, int num_threads) {
    const int halves = (fmt & (FMT_F16_SCALES | FMT_F32_MINS | FMT_SYM_MINS | FMT_ACT_BLOCKS)) / FMT_F16_SCALES;
    fmt &= ~(FMT_F16_SCALES | FMT_F32_MINS | FMT_SYM_MINS | FMT_ACT_BLOCKS);
    if (fmt == FMT_W4A8)
        return gemv_w4a8_m1_many(out, ldo, x, ldx, k, K, N, w, scale, mins, G, halves, bias, scratch, num_threads);
    if (fmt == FMT_F32) return dense_m1_many(out, ldo, x, ldx, k, K, N, w, bias, num_threads);
    return 0;
}
