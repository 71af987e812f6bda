/*
 * Quantized linear layers for a few tokens at a time (decode): y[M, N] = x[M, K] W^T (+ bias), reading
 * each weight byte once for all M rows of x. At small M these layers are bound by how fast the weights
 * stream from memory, so the weights stay quantized in memory and are widened in registers.
 *
 * Weight layouts (row n of W is output channel n):
 *   int8   w [N, K] int8, per-channel scale s[n]:                 W[n, k] = s[n] * w[n, k]
 *   int4   w [N, Kp / 2] uint8, Kp = K rounded up to the group size G (a multiple of 32), per-group
 *          scale and min as bf16 [N, Kp / G]:                    W[n, k] = scale * q + min, q in 0..15.
 *          Each 32-weight block is 16 bytes; byte j holds q[j] (low nibble) and q[j + 16] (high
 *          nibble), so one 16-byte load widens to two 16-lane vectors without shuffles.
 *   w8a8   the int8 weights above; x arrives quantized per row (xq [M, K] int8, xs[m] its scale):
 *          y[m, n] = xs[m] * s[n] * sum_k xq[m, k] w[n, k], summed exactly in int32.
 *
 * The M rows of x are processed against a block of 4 weight rows at once, so each weight vector load
 * feeds 4 x M FMAs. Threads split N. GCC vector extensions: AVX-512 where the CPU has it, narrower
 * registers elsewhere. Only the byte-widening loads use intrinsics (GCC 12 scalarises
 * __builtin_convertvector from 8-bit lanes): AVX-512, AVX2, or a plain loop.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
#define INLINE static inline __attribute__((always_inline))
#define MAX_M 16 /* rows of x per call into the row functions (scratch layout) */
#define MB 4     /* rows of x per register block: NB x MB accumulators stay in registers */
#define NB 4 /* weight rows per block */

INLINE v16 ld16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 16 signed bytes → 16 int32 lanes. */
INLINE v16i widen_s8(const int8_t *p) {
#if defined(__AVX512F__)
    return (v16i)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    v16i r;
    __m256i lo = _mm256_cvtepi8_epi32(b), hi = _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8));
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
#else
    v16i r;
    for (int i = 0; i < 16; i++) r[i] = p[i];
    return r;
#endif
}

/* 16 unsigned bytes → 16 int32 lanes. */
INLINE v16i widen_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    v16i r;
    __m256i lo = _mm256_cvtepu8_epi32(b), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
#else
    v16i r;
    for (int i = 0; i < 16; i++) r[i] = p[i];
    return r;
#endif
}

INLINE float hsum(v16 v) {
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One block of nb <= NB weight rows from row n against M rows of x (Kv floats apart); K not a multiple
 * of 16 runs a scalar tail. */
INLINE void int8_block(float *out, int64_t ldo, const float *xp, int64_t Kv, int M, const int8_t *w, int64_t K,
                      const float *scales, const float *bias, int64_t n, int nb) {
    {
        v16 acc[NB][MB];
        memset(acc, 0, sizeof acc);
        for (int64_t k = 0; k + 16 <= K; k += 16) {
            v16 wv[NB];
            for (int r = 0; r < NB; r++) {
                wv[r] = __builtin_convertvector(widen_s8(w + (n + (r < nb ? r : 0)) * K + k), v16);
            }
            for (int m = 0; m < M; m++) {
                v16 xv = ld16(xp + m * Kv + k);
                for (int r = 0; r < NB; r++) acc[r][m] += xv * wv[r];
            }
        }
        for (int r = 0; r < nb; r++) {
            for (int m = 0; m < M; m++) {
                float s = hsum(acc[r][m]);
                for (int64_t k = K & ~(int64_t)15; k < K; k++) s += xp[m * Kv + k] * (float)w[(n + r) * K + k];
                out[m * ldo + n + r] = s * scales[n + r] + (bias ? bias[n + r] : 0.f);
            }
        }
    }
}

/* One int4 block; xp is x zero-padded to Kp, xg[m][g] the sum of x over group g. */
INLINE void int4_block(float *out, int64_t ldo, const float *xp, const float *xg, int64_t Kp, int M,
                       const uint8_t *w, const uint16_t *scale, const uint16_t *mins, int64_t G, const float *bias,
                       int64_t n, int nb) {
    int64_t ng = Kp / G;
    v16 acc[NB][MB];
    float macc[NB][MB];
    memset(acc, 0, sizeof acc);
    memset(macc, 0, sizeof macc);
    for (int64_t g = 0; g < ng; g++) {
        float sc[NB];
        for (int r = 0; r < NB; r++) {
            int64_t row = n + (r < nb ? r : 0);
            sc[r] = bf16_to_f32(scale[row * ng + g]);
            float mn = bf16_to_f32(mins[row * ng + g]);
            for (int m = 0; m < M; m++) macc[r][m] += mn * xg[m * ng + g];
        }
        for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
            v16 lo[NB], hi[NB];
            for (int r = 0; r < NB; r++) {
                /* The group's scale goes into the widened codes: 2 multiplies per row, not one per row of x. */
                v16i b = widen_u8(w + (n + (r < nb ? r : 0)) * (Kp / 2) + k / 2);
                lo[r] = __builtin_convertvector(b & 15, v16) * sc[r];
                hi[r] = __builtin_convertvector(b >> 4, v16) * sc[r];
            }
            for (int m = 0; m < M; m++) {
                v16 x0 = ld16(xp + m * Kp + k), x1 = ld16(xp + m * Kp + k + 16);
                for (int r = 0; r < NB; r++) {
                    acc[r][m] += x0 * lo[r];
                    acc[r][m] += x1 * hi[r];
                }
            }
        }
    }
    for (int r = 0; r < nb; r++)
        for (int m = 0; m < M; m++)
            out[m * ldo + n + r] = hsum(acc[r][m]) + macc[r][m] + (bias ? bias[n + r] : 0.f);
}

/* One w8a8 block: exact int32 dot products (K < 2^17 keeps them in range). */
INLINE void w8a8_block(float *out, int64_t ldo, const int8_t *xq, int64_t Kv, const float *xs, int M,
                      const int8_t *w, int64_t K, const float *scales, const float *bias, int64_t n, int nb) {
    {
        v16i acc[NB][MB];
        memset(acc, 0, sizeof acc);
        for (int64_t k = 0; k + 16 <= K; k += 16) {
            v16i wv[NB];
            for (int r = 0; r < NB; r++) {
                wv[r] = widen_s8(w + (n + (r < nb ? r : 0)) * K + k);
            }
            for (int m = 0; m < M; m++) {
                v16i xv = widen_s8(xq + m * Kv + k);
                for (int r = 0; r < NB; r++) acc[r][m] += xv * wv[r];
            }
        }
        for (int r = 0; r < nb; r++) {
            for (int m = 0; m < M; m++) {
                int64_t s = 0;
                for (int i = 0; i < 16; i++) s += acc[r][m][i];
                for (int64_t k = K & ~(int64_t)15; k < K; k++) s += (int32_t)xq[m * Kv + k] * w[(n + r) * K + k];
                out[m * ldo + n + r] = (float)s * xs[m] * scales[n + r] + (bias ? bias[n + r] : 0.f);
            }
        }
    }
}

/* Calls BLOCK(c) for every n-block of this thread's share of N and every chunk of c <= MB rows of x
 * (c a literal, so each chunk size gets its own register-resident code). Weight rows stay in L1 while
 * the chunks of x pass over them. */
#define FOR_BLOCKS(N, mm, BLOCK)                                                    \
    do {                                                                            \
        int t_ = omp_get_thread_num(), nt_ = omp_get_num_threads();                 \
        int64_t blocks_ = ((N) + NB - 1) / NB;                                      \
        for (int64_t b_ = blocks_ * t_ / nt_; b_ < blocks_ * (t_ + 1) / nt_; b_++) { \
            int64_t n = b_ * NB;                                                    \
            int nb = (int)((N) - n < NB ? (N) - n : NB);                            \
            for (int j = 0; j < (mm); j += MB) {                                    \
                switch ((mm) - j < MB ? (mm) - j : MB) {                            \
                case 1: BLOCK(1); break;                                            \
                case 2: BLOCK(2); break;                                            \
                case 3: BLOCK(3); break;                                            \
                default: BLOCK(4); break;                                           \
                }                                                                   \
            }                                                                       \
        }                                                                           \
    } while (0)

/* x [M, K] rows ldx floats apart; out [M, N] rows ldo floats apart; scratch >= MAX_M * (K + 16) floats. */
void linear_int8_f32(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, const int8_t *w,
                     int64_t N, const float *scales, const float *bias, float *scratch, int num_threads) {
    int64_t Kv = (K + 15) & ~(int64_t)15;
    for (int m0 = 0; m0 < M; m0 += MAX_M) {
        int mm = M - m0 < MAX_M ? M - m0 : MAX_M;
        for (int m = 0; m < mm; m++) memcpy(scratch + m * Kv, x + (m0 + m) * ldx, K * sizeof(float));
        float *o = out + m0 * ldo;
#define B8(c) int8_block(o + j * ldo, ldo, scratch + j * Kv, Kv, c, w, K, scales, bias, n, nb)
#pragma omp parallel num_threads(num_threads)
        FOR_BLOCKS(N, mm, B8);
    }
}

/* scratch >= MAX_M * (Kp + Kp / G) floats. */
void linear_int4_f32(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, const uint8_t *w,
                     int64_t N, int64_t G, const uint16_t *scale, const uint16_t *mins, const float *bias,
                     float *scratch, int num_threads) {
    int64_t Kp = (K + G - 1) / G * G, ng = Kp / G;
    for (int m0 = 0; m0 < M; m0 += MAX_M) {
        int mm = M - m0 < MAX_M ? M - m0 : MAX_M;
        float *xp = scratch, *xg = scratch + (int64_t)MAX_M * Kp;
        for (int m = 0; m < mm; m++) {
            memcpy(xp + m * Kp, x + (m0 + m) * ldx, K * sizeof(float));
            memset(xp + m * Kp + K, 0, (Kp - K) * sizeof(float));
            for (int64_t g = 0; g < ng; g++) {
                float s = 0.f;
                for (int64_t k = g * G; k < (g + 1) * G; k++) s += xp[m * Kp + k];
                xg[m * ng + g] = s;
            }
        }
        float *o = out + m0 * ldo;
#define B4(c) int4_block(o + j * ldo, ldo, xp + j * Kp, xg + j * ng, Kp, c, w, scale, mins, G, bias, n, nb)
#pragma omp parallel num_threads(num_threads)
        FOR_BLOCKS(N, mm, B4);
    }
}

/* Quantizes x per row (symmetric, absmax / 127, round half to even as torch.round) into scratch, then
 * the int8 x int8 products. scratch >= MAX_M floats + MAX_M * (K + 16) bytes. */
void linear_w8a8_f32(float *out, int64_t ldo, const float *x, int64_t ldx, int M, int64_t K, const int8_t *w,
                     int64_t N, const float *scales, const float *bias, void *scratch, int num_threads) {
    int64_t Kv = (K + 15) & ~(int64_t)15;
    float *xs = (float *)scratch;
    int8_t *xq = (int8_t *)(xs + MAX_M);
    for (int m0 = 0; m0 < M; m0 += MAX_M) {
        int mm = M - m0 < MAX_M ? M - m0 : MAX_M;
        for (int m = 0; m < mm; m++) {
            const float *xr = x + (m0 + m) * ldx;
            float amax = 0.f;
            for (int64_t k = 0; k < K; k++) amax = xr[k] > amax ? xr[k] : (-xr[k] > amax ? -xr[k] : amax);
            float s = amax > 0.f ? amax / 127.f : 1.f;
            xs[m] = s;
            for (int64_t k = 0; k < K; k++) xq[m * Kv + k] = (int8_t)__builtin_lrintf(xr[k] / s);
        }
        float *o = out + m0 * ldo;
#define BW(c) w8a8_block(o + j * ldo, ldo, xq + j * Kv, Kv, xs + j, c, w, K, scales, bias, n, nb)
#pragma omp parallel num_threads(num_threads)
        FOR_BLOCKS(N, mm, BW);
    }
}
