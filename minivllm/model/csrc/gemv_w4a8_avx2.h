/* csrc/gemv_w4a8.c's rows for AVX2 without VNNI; included there after W4A8Layer and halff (where W4A8_AVX2).
 *
 * vpmaddubsw multiplies 32 nibbles (unsigned bytes) by 32 activation bytes and adds pairs (at most 2 * 15 * 127:
 * no saturation), vpmaddwd against ones widens to int32, one FMA scales a pair of blocks (lanes 0-3 the first
 * block, 4-7 the second). Each weight row's group scales and mins are converted to float once, 8 per instruction
 * (per pair of blocks: one load and a permute, where two scalar conversions and a merge took six instructions; the
 * min term a vector dot product with xg, where its scalar loop, a chain of dependent adds, took a third of the
 * row). At one token four weight rows go per pass, each load of x serving all four (csrc/gemv.c's float rows
 * gained 1.2-1.5x so on a 2-core AVX2 EPYC; these measured no faster there, 10-13 GB/s either way: they are
 * bound by their instructions, not the memory). The portable loop took 3-4x as long as one row of this. */
#ifndef MINIVLLM_GEMV_W4A8_AVX2_H
#define MINIVLLM_GEMV_W4A8_AVX2_H
#ifdef W4A8_AVX2 /* (a CPU without AVX2 takes the portable rows) */
#include "hsum_avx2.h"

/* Row n's scales into sf[0, ng) and, where stored as half floats, its mins into sf[ng + 8, ...); returns the
 * mins as float (the scales where symmetric: their term is then -8 times the scales'). */
static inline const float *row_floats(const W4A8Layer *L, int64_t n, float *sf) {
    const int64_t ng = L->ng;
    const uint16_t *sc = L->scale + n * ng;
    const char *mn = L->sym ? (const char *)sc : (const char *)L->mins + n * ng * (L->f32mins ? 4 : 2);
    float *mf = sf + ng + 8;
    const int cvt_mins = !L->sym && !L->f32mins;
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(sc + g));
        _mm256_storeu_ps(sf + g, L->f16 ? _mm256_cvtph_ps(h)
                                        : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
        if (cvt_mins) {
            const __m128i hm = _mm_loadu_si128((const __m128i *)((const uint16_t *)mn + g));
            _mm256_storeu_ps(mf + g, L->f16 ? _mm256_cvtph_ps(hm)
                                            : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hm), 16)));
        }
    }
    for (; g < ng; g++) {
        sf[g] = halff(sc[g], L->f16);
        if (cvt_mins) mf[g] = halff(((const uint16_t *)mn)[g], L->f16);
    }
    return L->sym ? sf : L->f32mins ? (const float *)mn : mf;
}

static inline __attribute__((always_inline)) float hsum8(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    float f[4];
    _mm_storeu_ps(f, h);
    return (f[0] + f[1]) + (f[2] + f[3]);
}

/* 32 weight bytes as their low and high nibbles (unsigned bytes: vpmaddubsw's first operand). */
static inline __attribute__((always_inline)) void nibbles(__m256i wv, __m256i *lo, __m256i *hi) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    *lo = _mm256_and_si256(wv, nib);
    *hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), nib);
}

/* A pair of blocks' nibbles against their activation bytes (xl: the low halves, xh: the high): 8 int32 sums as
 * float, lanes 0-3 the first block's, 4-7 the second's. */
static inline __attribute__((always_inline)) __m256 pair_dot(__m256i lo, __m256i hi, __m256i xl, __m256i xh) {
    const __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(d, _mm256_set1_epi16(1)));
}

/* [s[0] x4, s[1] x4]: a pair's two block scales (groups of 32), one load and a permute. */
static inline __attribute__((always_inline)) __m256 pair_scale(const float *s) {
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd((const double *)s))),
                                    _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

/* sum_g min[g] * xg[g] (times mscale: -8 where the mins are the scales) plus the row's accumulated block sums. */
static inline __attribute__((always_inline)) float row_total(const float *mins, const float *xg, int64_t ng,
                                                             float mscale, __m256 acc) {
    __m256 t = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8) t = _mm256_fmadd_ps(_mm256_loadu_ps(mins + g), _mm256_loadu_ps(xg + g), t);
    float rest = 0.f;
    for (; g < ng; g++) rest += mins[g] * xg[g];
    return hsum8(_mm256_fmadd_ps(t, _mm256_set1_ps(mscale), acc)) + mscale * rest;
}

/* R weight rows from n (R 1 or 4) against M rows of x (M 1 where R is 4); sf holds R * 2 * (ng + 8) floats; xb:
 * x's block scales (rows ngp apart) or NULL. */
static inline __attribute__((always_inline)) void rows_avx2(float *out, int64_t ldo, const int8_t *xq,
                                                            const float *xs, const float *xg, const float *xb, int M,
                                                            const W4A8Layer *L, int64_t n, int R, float *sf) {
    const int64_t nblocks = L->Kp / 32, bpg = L->G / 32, ng = L->ng, rowb = L->Kp / 2;
    const float *mins[4], *sfr[4];
    for (int r = 0; r < R; r++) {
        sfr[r] = sf + r * 2 * (ng + 8);
        mins[r] = row_floats(L, n + r, sf + r * 2 * (ng + 8));
    }
    const uint8_t *w = L->w + n * rowb;
    __m256 acc[MB];
    float tail[MB] = {0.f};
    for (int i = 0; i < R * M; i++) acc[i] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nblocks; b += 2) { /* (b even: both blocks of a pair in one group whenever groups span two+) */
        const int8_t *xk = xq + (b / 4) * 128 + (b % 4) * 16; /* low halves; high halves 64 bytes on */
        __m256i xl[MB], xh[MB];
        for (int m = 0; m < M; m++) {
            xl[m] = _mm256_loadu_si256((const __m256i *)(xk + m * L->Kx));
            xh[m] = _mm256_loadu_si256((const __m256i *)(xk + m * L->Kx + 64));
        }
        for (int r = 0; r < R; r++) {
            __m256i lo, hi;
            nibbles(_mm256_loadu_si256((const __m256i *)(w + r * rowb + b * 16)), &lo, &hi);
            const __m256 s = bpg > 1 ? _mm256_broadcast_ss(sfr[r] + b / bpg) : pair_scale(sfr[r] + b);
            for (int m = 0; m < M; m++) {
                const __m256 sm = xb ? _mm256_mul_ps(s, pair_scale(xb + m * L->ngp + b)) : s; /* (bpg 1) */
                acc[r * M + m] = _mm256_fmadd_ps(pair_dot(lo, hi, xl[m], xh[m]), sm, acc[r * M + m]);
            }
        }
    }
    if (b < nblocks) { /* an odd last block: 16 bytes (a 32-byte load could leave the allocation) */
        const __m128i nb = _mm_set1_epi8(0x0F);
        const int8_t *xk = xq + (b / 4) * 128 + (b % 4) * 16;
        for (int r = 0; r < R; r++) {
            const __m128i wv = _mm_loadu_si128((const __m128i *)(w + r * rowb + b * 16));
            const __m128i lo = _mm_and_si128(wv, nb), hi = _mm_and_si128(_mm_srli_epi16(wv, 4), nb);
            for (int m = 0; m < M; m++) {
                const int8_t *xr = xk + m * L->Kx;
                const __m128i d = _mm_madd_epi16(
                    _mm_add_epi16(_mm_maddubs_epi16(lo, _mm_loadu_si128((const __m128i *)xr)),
                                  _mm_maddubs_epi16(hi, _mm_loadu_si128((const __m128i *)(xr + 64)))),
                    _mm_set1_epi16(1));
                int32_t v[4];
                _mm_storeu_si128((__m128i *)v, d);
                tail[r * M + m] = (float)((v[0] + v[1]) + (v[2] + v[3])) * sfr[r][b / bpg] *
                                  (xb ? xb[m * L->ngp + b] : 1.f);
            }
        }
    }
    const float mscale = L->sym ? -8.f : 1.f; /* (symmetric rows: each min is -8 scale) */
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) {
            const float y = row_total(mins[r], xg + m * L->ngp, ng, mscale, acc[r * M + m]);
            out[m * ldo + n + r] = (y + tail[r * M + m]) * xs[m] + (L->bias ? L->bias[n + r] : 0.f);
        }
}

/* A pair of blocks' two scales as [s[0] x4, s[1] x4] straight from the weights' half floats (f16: float16, else
 * bfloat16, float32's upper half): one broadcast load and a byte shuffle (and a conversion for float16). In the
 * pair loop these replaced row_floats' pass over each row's scales, its stores and reloads: 1.13-1.15x on weights
 * in the L3 (2 threads, 1B-shaped rows, a 2-core AVX2 EPYC). */
static inline __attribute__((always_inline)) __m256 pair_scale_half(const uint16_t *s, const int f16) {
    int32_t v;
    memcpy(&v, s, sizeof v);
    if (f16)
        return _mm256_cvtph_ps(_mm_shuffle_epi8(_mm_cvtsi32_si128(v), _mm_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1,
                                                                                     2, 3, 2, 3, 2, 3, 2, 3)));
    const __m256i pick = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 0, 1, -1, -1, 0, 1, -1, -1, 0, 1,
                                          -1, -1, 2, 3, -1, -1, 2, 3, -1, -1, 2, 3, -1, -1, 2, 3);
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(_mm256_set1_epi32(v), pick));
}

/* One half-float scale in every lane (a 16-bit broadcast load; bfloat16: the low halves cleared). */
static inline __attribute__((always_inline)) __m256 bcast_half(const uint16_t *s, const int f16) {
    if (f16) return _mm256_cvtph_ps(_mm_set1_epi16((short)*s));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_set1_epi16((short)*s), _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* row_total for half-float mins (the scales where symmetric), widened as they meet xg. */
static inline __attribute__((always_inline)) float row_total_half(const uint16_t *mins, const float *xg, int64_t ng,
                                                                  float mscale, __m256 acc, const int f16) {
    __m256 t = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(mins + g));
        const __m256 m = f16 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        t = _mm256_fmadd_ps(m, _mm256_loadu_ps(xg + g), t);
    }
    float rest = 0.f;
    for (; g < ng; g++) rest += halff(mins[g], f16) * xg[g];
    return hsum8(_mm256_fmadd_ps(t, _mm256_set1_ps(mscale), acc)) + mscale * rest;
}

/* One token, R (4, 2 or 1: constants at each call) weight rows n .. n+R-1 a pass, an even number of blocks: each
 * load of x serves the R rows, their accumulators stay in registers, the scale lookup is chosen once (the general
 * loop re-tested it per row and pair and stored every accumulator back to the stack). `ahead` bytes on (the next
 * pass), the rows' weights are prefetched into L1 (L2 where L->l2), their scales and mins too: rows of 1-4 KiB are
 * short for the hardware prefetcher to learn. Which R streams fastest is the memory system's (model/row_order.py
 * times 4 and 2 a pass, then one by one from a length, as on AVX-512): on a 2-core AVX2 EPYC two rows a pass read a
 * 1B-shaped chain 1.11-1.14x as fast as four; two passes ahead read 0.97x of one. f16: float16 scales, else
 * bfloat16. */
static inline __attribute__((always_inline)) void rows_m1_avx2(float *out, const int8_t *xq, float xs,
                                                               const float *xg, const float *xb, const W4A8Layer *L,
                                                               int64_t n, int64_t ahead, const int f16, const int R) {
    const int64_t npairs = L->Kp / 64, ng = L->ng, rowb = L->Kp / 2, bpg = L->G / 32;
    const int shift = __builtin_ctzll((unsigned long long)bpg); /* (G a power of two: 32 .. 256) */
    const int64_t mbytes = L->f32mins ? 4 : 2;
    const uint16_t *sc = L->scale + n * ng;
    const char *mn = L->sym ? (const char *)sc : (const char *)L->mins + n * ng * mbytes;
    const int l2 = L->l2;
    if (ahead) /* the next pass's scales and mins (csrc/gemv_rows.h) */
        prefetch_groups(L->scale, L->sym ? NULL : L->mins, n + R, R, ng, (int)mbytes);
    const uint8_t *w = L->w + n * rowb;
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
#define W4A8_ROW(r, q, xl, xh, s)                                                                                    \
    do {                                                                                                             \
        __m256i lo, hi;                                                                                              \
        nibbles(_mm256_loadu_si256((const __m256i *)(w + (r) * rowb + (q) * 32)), &lo, &hi);                        \
        acc[r] = _mm256_fmadd_ps(pair_dot(lo, hi, xl, xh), (s), acc[r]);                                            \
    } while (0)
#define PAIR_SCALE(r, q) (xb ? _mm256_mul_ps(pair_scale_half(sc + (r) * ng + 2 * (q), f16), xsc)                      \
                             : pair_scale_half(sc + (r) * ng + 2 * (q), f16))
#define PAIRS(q, xlo, xhi)                                                                                           \
    do {                                                                                                             \
        const __m256i xl = (xlo), xh = (xhi);                                                                        \
        if (shift == 0) { /* (x's block scales, where it has them: groups of 32) */                                  \
            const __m256 xsc = xb ? pair_scale(xb + 2 * (q)) : _mm256_setzero_ps();                                  \
            for (int r = 0; r < R; r++) W4A8_ROW(r, q, xl, xh, PAIR_SCALE(r, q));                                    \
        } else {                                                                                                     \
            const int64_t g = (2 * (q)) >> shift;                                                                    \
            for (int r = 0; r < R; r++) W4A8_ROW(r, q, xl, xh, bcast_half(sc + r * ng + g, f16));                    \
        }                                                                                                            \
    } while (0)
#define LOAD_X(p) _mm256_loadu_si256((const __m256i *)(p))
    int64_t p = 0;
    for (; p + 2 <= npairs; p += 2) { /* two pairs (one 128-weight chunk of x) per iteration: 1.17x one pair */
        const int8_t *xk = xq + (p >> 1) * 128; /* the chunk's low halves; high halves 64 on */
        if (ahead) /* the next R rows over this pass's pairs: R lines an iteration */
            for (int c = 0; c < R; c++) {
                const uint8_t *pf = w + ahead + p * 32 * R + 64 * c;
                if (l2) __builtin_prefetch(pf, 0, 2);
                else __builtin_prefetch(pf);
            }
        PAIRS(p, LOAD_X(xk), LOAD_X(xk + 64));
        PAIRS(p + 1, LOAD_X(xk + 32), LOAD_X(xk + 96));
    }
    if (p < npairs) PAIRS(p, LOAD_X(xq + (p >> 1) * 128), LOAD_X(xq + (p >> 1) * 128 + 64)); /* an odd last pair */
#undef PAIRS
#undef LOAD_X
#undef W4A8_ROW
#undef PAIR_SCALE
    const float mscale = L->sym ? -8.f : 1.f;
    for (int r = 0; r < R; r++) {
        const float y = L->f32mins ? row_total((const float *)mn + r * ng, xg, ng, mscale, acc[r])
                                   : row_total_half((const uint16_t *)mn + r * ng, xg, ng, mscale, acc[r], f16);
        out[n + r] = y * xs + (L->bias ? L->bias[n + r] : 0.f);
    }
}

/* One weight row against M (1..8) tokens, an even number of blocks: the pair's nibbles and scales are decoded
 * once for all M, every accumulator stays in a register, the x loads are folded into the multiply-adds
 * (rows_avx2 with M rows kept x in 2M registers and spilled its accumulators to the stack every pair: perf put a
 * third of a 64-token GEMV on those stores and the index arithmetic). sf: the row's scales (row_floats); mv: its
 * mins times mscale, zero-padded to ngp, which meet xg in the same accumulators; one transposed reduction for
 * all M (the per-token reductions and min terms were a fifth of a 576-wide row's instructions). */
static inline __attribute__((always_inline)) void row_mt_avx2(float *out, int64_t ldo, const int8_t *xq,
                                                              const float *xs, const float *xg, const float *xb,
                                                              const int M, const W4A8Layer *L, int64_t n,
                                                              const float *sf, const float *mv) {
    const int64_t nchunks = L->Kp / 128, rowb = L->Kp / 2, bpg = L->G / 32, Kx = L->Kx;
    const int shift = __builtin_ctzll((unsigned long long)bpg);
    const uint8_t *w = L->w + n * rowb;
    __m256 acc[8];
    for (int m = 0; m < 8; m++) acc[m] = _mm256_setzero_ps();
#define W4A8_PAIR(wp, xo, s, b)                                                                                      \
    do { /* b: the pair's first block (x's block scales, where it has them: groups of 32) */                         \
        __m256i lo, hi;                                                                                              \
        nibbles(_mm256_loadu_si256((const __m256i *)(wp)), &lo, &hi);                                                \
        const __m256 sv = (s);                                                                                       \
        for (int m = 0; m < M; m++) {                                                                                \
            const int8_t *xm = xq + m * Kx + (xo);                                                                   \
            acc[m] = _mm256_fmadd_ps(pair_dot(lo, hi, _mm256_loadu_si256((const __m256i *)xm),                      \
                                              _mm256_loadu_si256((const __m256i *)(xm + 64))),                       \
                                     xb ? _mm256_mul_ps(sv, pair_scale(xb + m * L->ngp + (b))) : sv, acc[m]);        \
        }                                                                                                            \
    } while (0)
#define PAIR_SCALE(q) pair_scale(sf + 2 * (q)) /* [scale of block 2q x4, of block 2q+1 x4] */
    int64_t c = 0;
    if (shift == 0) { /* groups of 32: each block its own scale */
        for (; c < nchunks; c++) {
            W4A8_PAIR(w + c * 64, c * 128, PAIR_SCALE(2 * c), 4 * c);
            W4A8_PAIR(w + c * 64 + 32, c * 128 + 32, PAIR_SCALE(2 * c + 1), 4 * c + 2);
        }
    } else {
        for (; c < nchunks; c++) {
            W4A8_PAIR(w + c * 64, c * 128, _mm256_broadcast_ss(sf + ((4 * c) >> shift)), 4 * c);
            W4A8_PAIR(w + c * 64 + 32, c * 128 + 32, _mm256_broadcast_ss(sf + ((4 * c + 2) >> shift)), 4 * c + 2);
        }
    }
    if (2 * nchunks < L->Kp / 64) { /* an odd last pair: the low halves of the chunk's first two blocks */
        const __m256 last = shift == 0 ? PAIR_SCALE(2 * c) : _mm256_broadcast_ss(sf + ((4 * c) >> shift));
        W4A8_PAIR(w + c * 64, c * 128, last, 4 * c);
    }
#undef W4A8_PAIR
#undef PAIR_SCALE
    for (int64_t g = 0; g < L->ngp; g += 8) {
        const __m256 mg = _mm256_loadu_ps(mv + g);
        for (int m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(mg, _mm256_loadu_ps(xg + m * L->ngp + g), acc[m]);
    }
    float y[8];
    _mm256_storeu_ps(y, hsum8x8(acc));
    for (int m = 0; m < M; m++) out[m * ldo + n] = y[m] * xs[m] + (L->bias ? L->bias[n] : 0.f);
}

/* Weight row n against all M tokens, 8 per pass: the row's scales and mins converted once (sf holds
 * 2 * (ng + 8) + ngp floats). */
static inline void row_all_tokens_avx2(float *out, int64_t ldo, const int8_t *xq, const float *xs, const float *xg,
                                       const float *xb, int M, const W4A8Layer *L, int64_t n, float *sf) {
    const int64_t ng = L->ng;
    const float *mins = row_floats(L, n, sf), mscale = L->sym ? -8.f : 1.f;
    float *mv = sf + 2 * (ng + 8);
    for (int64_t g = 0; g < L->ngp; g++) mv[g] = g < ng ? mscale * mins[g] : 0.f;
    for (int j = 0; j < M; j += 8) {
        const int8_t *xqj = xq + j * L->Kx;
        float *o = out + j * ldo;
        const float *xgj = xg + j * L->ngp, *xsj = xs + j, *xbj = xb ? xb + j * L->ngp : NULL;
#define ROW_MT(c) row_mt_avx2(o, ldo, xqj, xsj, xgj, xbj, c, L, n, sf, mv)
        SWITCH_M8(M - j < 8 ? M - j : 8, ROW_MT);
#undef ROW_MT
    }
}

#endif
#endif
