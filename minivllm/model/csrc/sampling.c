/*
 * Random sampling of one token per row, for CPU: temperature → min_p → top_k → top_p → draw, in
 * O(vocab) per row. Sorting a 49k-entry row costs ~2 ms here (125 ms for 64 rows). Instead, the
 * top-k / top-p boundaries are found with a histogram over the top 16 bits of the (positive) float
 * probabilities, whose bit patterns order like their values, then a quickselect inside the one
 * boundary bucket: two linear passes (a quickselect over the whole row measured 7x slower). A row with a
 * small top_k (<= 256, the common case) never runs the exp pass over the row: see sample_top_k.
 *
 * Semantics (identical to the portable torch path, minimal-set definitions as vLLM / HF):
 *   p_i      = exp((x_i - max x) / T)                      (unnormalised; the max token has p = 1)
 *   min_p    : keep p_i >= min_p * max p = min_p
 *   top_k    : keep p_i >= the k-th largest kept value    (ties at the boundary are kept)
 *   top_p    : with K = mass kept so far, drop the smallest tokens while the mass of all tokens
 *              with p <= p_i stays <= (1 - top_p) * K; the largest token is always kept
 *   draw     : u in [0, 1) per row; the first kept token (in id order) whose running mass
 *              exceeds u * (kept mass)
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define NBUCKETS 16384 /* top 16 bits of a float in (0, 1]: 1.0f is 0x3F80'0000 */
#define TOPK_INSERT_MAX 256
#define TOPP_DIRECT_MAX 4096 /* top_p over at most this many kept tokens selects on them directly */ /* top_k up to this uses the insertion pass, larger k the histogram */

static inline uint32_t bucket(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u >> 16;
}

/* Rearrange a[0..n) into [< pivot | == pivot | > pivot]; returns the two boundaries. */
static void partition3(float *a, int64_t n, float pivot, int64_t *lt_end, int64_t *gt_start) {
    int64_t lt = 0, i = 0, gt = n;
    while (i < gt) {
        const float v = a[i];
        if (v < pivot) {
            a[i] = a[lt];
            a[lt++] = v;
            i++;
        } else if (v > pivot) {
            a[i] = a[--gt];
            a[gt] = v;
        } else {
            i++;
        }
    }
    *lt_end = lt;
    *gt_start = gt;
}

static float median3(float a, float b, float c) {
    if (a > b) { float t = a; a = b; b = t; }
    if (b > c) b = c;
    return a > b ? a : b;
}

/* Whether f is finite, by its bits: the library is built with -ffast-math, under which isfinite() and comparisons
 * with infinities may be folded away. */
static inline int finite_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x7F800000u) != 0x7F800000u;
}

/* The k-th largest value of a[0..n) (k >= 1); a is reordered. Past the entries (k > n, which only non-finite
 * input can cause) it gives up with -FLT_MAX rather than loop. */
static float kth_largest(float *a, int64_t n, int64_t k) {
    while (1) {
        if (n <= 0) return -FLT_MAX;
        const float pivot = median3(a[0], a[n / 2], a[n - 1]);
        int64_t lt, gt;
        partition3(a, n, pivot, &lt, &gt);
        const int64_t n_gt = n - gt, n_eq = gt - lt;
        if (k <= n_gt) {
            a += gt;
            n = n_gt;
        } else if (k <= n_gt + n_eq) {
            return pivot;
        } else {
            k -= n_gt + n_eq;
            n = lt;
        }
    }
}

/* Smallest value v of a[0..n) such that the mass of all entries <= v exceeds r (r < total mass). */
static float mass_threshold(float *a, int64_t n, double r) {
    while (1) {
        if (n <= 0) return 1.0f; /* (only non-finite input gets here: keep the top token) */
        const float pivot = median3(a[0], a[n / 2], a[n - 1]);
        int64_t lt, gt;
        partition3(a, n, pivot, &lt, &gt);
        double m_lt = 0.0;
        for (int64_t i = 0; i < lt; i++) m_lt += a[i];
        const double m_eq = (double)pivot * (double)(gt - lt);
        if (lt > 0 && m_lt > r) {
            n = lt;
        } else if (m_lt + m_eq > r || gt == n) {
            return pivot;
        } else {
            r -= m_lt + m_eq;
            a += gt;
            n -= gt;
        }
    }
}

/* Entries of p >= thr that fall in bucket b, copied to work; returns how many. */
static int64_t collect(const float *p, int64_t vocab, float thr, uint32_t b, float *work) {
    int64_t n = 0;
    for (int64_t i = 0; i < vocab; i++)
        if (p[i] >= thr && bucket(p[i]) == b) work[n++] = p[i];
    return n;
}

/* The k-th largest of the entries of p that are >= thr (k <= their count). */
static float kth_largest_hist(const float *p, int64_t vocab, float thr, int64_t k, float *work, double *hist) {
    memset(hist, 0, NBUCKETS * sizeof(double));
    for (int64_t i = 0; i < vocab; i++)
        if (p[i] >= thr) hist[bucket(p[i])] += 1.0;
    int64_t b = NBUCKETS - 1;
    double above = 0.0;
    for (; b > 0 && above + hist[b] < (double)k; b--) above += hist[b];
    return kth_largest(work, collect(p, vocab, thr, (uint32_t)b, work), k - (int64_t)above);
}

/* Smallest value v among the entries of p that are >= thr such that their mass at or below v
 * exceeds r. */
static float mass_threshold_hist(const float *p, int64_t vocab, float thr, double r, float *work, double *hist) {
    memset(hist, 0, NBUCKETS * sizeof(double));
    for (int64_t i = 0; i < vocab; i++)
        if (p[i] >= thr) hist[bucket(p[i])] += p[i];
    int64_t b = 0;
    double below = 0.0;
    for (; b < NBUCKETS - 1 && below + hist[b] <= r; b++) below += hist[b];
    const int64_t n = collect(p, vocab, thr, (uint32_t)b, work);
    /* No bucket crossed r (top_p so small that rounding ate the whole margin): keep the top token(s). */
    return n ? mass_threshold(work, n, r - below) : 1.0f;
}

/* Mass and count of the entries >= thr (vectorised: these sums are most of the per-row work). */
static double kept_mass(const float *p, int64_t vocab, float thr, int64_t *count) {
    double mass = 0.0;
    int64_t n = 0;
#pragma omp simd reduction(+ : mass, n)
    for (int64_t i = 0; i < vocab; i++) {
        const int keep = p[i] >= thr;
        mass += keep ? (double)p[i] : 0.0;
        n += keep;
    }
    *count = n;
    return mass;
}

/* The k largest entries of x (k >= 1), largest first, lower id first among equals, into vals / ids.
 * Blocks of 128 whose maximum cannot enter the list are skipped with one vectorised max (a horizontal
 * reduction per block, so blocks are long): after the first few blocks almost every block is skipped. */
static void topk_insert(const float *x, int64_t vocab, int64_t k, float *vals, int64_t *ids) {
    int64_t filled = 0;
    for (int64_t b = 0; b < vocab; b += 128) {
        const int64_t e = b + 128 < vocab ? b + 128 : vocab;
        if (filled == k) {
            float bm = x[b];
#pragma omp simd reduction(max : bm)
            for (int64_t i = b + 1; i < e; i++) bm = x[i] > bm ? x[i] : bm;
            if (!(bm > vals[k - 1])) continue;
        }
        for (int64_t i = b; i < e; i++) {
            const float v = x[i];
            if (filled == k && !(v > vals[k - 1])) continue;
            int64_t j = filled < k ? filled++ : k - 1;
            while (j > 0 && vals[j - 1] < v) {
                vals[j] = vals[j - 1];
                ids[j] = ids[j - 1];
                j--;
            }
            vals[j] = v;
            ids[j] = i;
        }
    }
}

/* The first kept token (p >= thr, in id order) whose running mass exceeds target; the last kept token
 * if rounding leaves the target unreached. Blocks of 256 are summed vectorised and skipped whole until
 * the one that crosses the target, which is scanned entry by entry. */
static int64_t draw(const float *p, int64_t vocab, float thr, double target) {
    double acc = 0.0;
    for (int64_t b = 0; b < vocab; b += 256) {
        const int64_t e = b + 256 < vocab ? b + 256 : vocab;
        double bs = 0.0;
#pragma omp simd reduction(+ : bs)
        for (int64_t i = b; i < e; i++) bs += p[i] >= thr ? (double)p[i] : 0.0;
        if (acc + bs <= target) {
            acc += bs;
            continue;
        }
        for (int64_t i = b; i < e; i++) {
            if (p[i] >= thr) {
                acc += p[i];
                if (acc > target) return i;
            }
        }
    }
    int64_t i = vocab - 1;
    while (i > 0 && !(p[i] >= thr)) i--;
    return i;
}

/* A row with a small top_k: everything happens on its candidates, never on the whole vocabulary. The maxima of
 * blocks of the row (one vectorised pass) give a floor: the k-th largest block maximum has at least k entries at
 * or above it. The blocks that reach it (about k) list their entries at or above it in id order (a few times k);
 * a quickselect on them gives the k-th largest logit, and the candidates are the entries at or above it (ties at
 * the boundary kept, as the general path keeps them). Then exp, min_p, top_p and the draw run over those few
 * entries: the same sets and the same id-order draw as the general path (p is monotone in x), without its exp
 * and selection passes over the row. ids: vocab int32, cp: vocab floats, bmax: 2 * NBUCKETS floats of scratch.
 * Returns -1 where the general path must run instead (a row of mass ties). */
static int64_t sample_top_k(const float *x, int64_t vocab, int64_t k, float temperature, float top_p, float min_p,
                            double u, int32_t *ids, float *cp, float *bmax) {
    int64_t bs = 128;
    while (bs > 8 && vocab / bs < 2 * k) bs /= 2;
    const int64_t nb = (vocab + bs - 1) / bs;
    if (nb < k || nb > NBUCKETS) return -1;
    float *sel = bmax + nb; /* a copy the quickselect may reorder */
    float m = -FLT_MAX;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t e = (b + 1) * bs < vocab ? (b + 1) * bs : vocab;
        float v = x[b * bs];
#pragma omp simd reduction(max : v)
        for (int64_t i = b * bs + 1; i < e; i++) v = x[i] > v ? x[i] : v;
        bmax[b] = sel[b] = v;
        m = v > m ? v : m;
    }
    const float floor_x = kth_largest(sel, nb, k);
    int64_t c = 0;
    for (int64_t b = 0; b < nb; b++) { /* only the blocks that reach the floor: about k of them */
        if (!(bmax[b] >= floor_x)) continue;
        const int64_t e = (b + 1) * bs < vocab ? (b + 1) * bs : vocab;
        for (int64_t i = b * bs; i < e; i++)
            if (x[i] >= floor_x) ids[c++] = (int32_t)i;
    }
    if (2 * c > vocab) return -1; /* the selection below needs c more floats */
    for (int64_t j = 0; j < c; j++) cp[c + j] = x[ids[j]];
    const float xk = kth_largest(cp + c, c, k);
    int64_t kept_c = 0;
    for (int64_t j = 0; j < c; j++)
        if (x[ids[j]] >= xk) ids[kept_c++] = ids[j];
    c = kept_c;
    const float inv_t = 1.0f / temperature;
    const float thr0 = min_p > FLT_MIN ? min_p : FLT_MIN; /* max p is exactly 1 */
    double kept = 0.0;
    int64_t n = 0;
    for (int64_t j = 0; j < c; j++) {
        const float d = (x[ids[j]] - m) * inv_t;
        cp[j] = d > -87.f ? expf(d) : 0.f;
        if (cp[j] >= thr0) {
            kept += cp[j];
            n++;
        }
    }
    float thr = thr0;
    if (top_p < 1.f && n > 1) {
        float *sel = cp + c; /* the free tail of cp (c <= vocab / 2) */
        int64_t s = 0;
        for (int64_t j = 0; j < c; j++)
            if (cp[j] >= thr0) sel[s++] = cp[j];
        thr = mass_threshold(sel, s, (1.0 - (double)top_p) * kept);
        kept = 0.0;
        for (int64_t j = 0; j < c; j++)
            if (cp[j] >= thr) kept += cp[j];
    }
    const double target = u * kept;
    double acc = 0.0;
    int64_t last = ids[0];
    for (int64_t j = 0; j < c; j++) {
        if (cp[j] >= thr) {
            acc += cp[j];
            last = ids[j];
            if (acc > target) return ids[j];
        }
    }
    return last;
}

/* The first index of the largest entry (torch.argmax's choice among ties): a vectorised max, then a
 * scan that stops at it. */
static int64_t argmax_first(const float *x, int64_t vocab) {
    float m = x[0];
#pragma omp simd reduction(max : m)
    for (int64_t i = 1; i < vocab; i++) m = x[i] > m ? x[i] : m;
    int64_t i = 0;
    while (i < vocab - 1 && x[i] != m) i++;
    return i;
}

/* logits [rows, vocab] (read only); a row with temperature <= 0 is greedy (argmax, u unused), so one call
 * serves a whole mixed batch without gathering rows. scratch: num_threads * (2 * vocab + 2 * NBUCKETS)
 * floats. */
void sample_rows_f32(const float *logits, int64_t rows, int64_t vocab, const float *temperature, const int64_t *top_k,
                     const float *top_p, const float *min_p, const double *u, int64_t *out, float *scratch,
                     int num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * vocab;
        if (temperature[r] <= 0.f) {
            out[r] = argmax_first(x, vocab);
            continue;
        }
        float *p = scratch + (size_t)omp_get_thread_num() * (2 * vocab + 2 * NBUCKETS);
        float *work = p + vocab;
        double *hist = (double *)(work + vocab);
        float top = x[0];
#pragma omp simd reduction(max : top)
        for (int64_t i = 1; i < vocab; i++) top = x[i] > top ? x[i] : top;
        /* Every token forbidden (-inf: the max reduction's identity is -FLT_MAX, so an all -inf row reads as that),
         * or NaN: no distribution to draw from; the first id, as the greedy path's argmax gives. */
        if (!finite_bits(top) || top <= -FLT_MAX) {
            out[r] = 0;
            continue;
        }
        if (top_k[r] > 0 && top_k[r] <= TOPK_INSERT_MAX && top_k[r] < vocab) {
            out[r] = sample_top_k(x, vocab, top_k[r], temperature[r], top_p[r], min_p[r], u[r], (int32_t *)p, work,
                                  (float *)hist);
            if (out[r] >= 0) continue;
        }
        float m = x[0];
#pragma omp simd reduction(max : m)
        for (int64_t i = 1; i < vocab; i++) m = x[i] > m ? x[i] : m;
        const float inv_t = 1.0f / temperature[r];
        /* Banned tokens arrive as -inf; the library is built with -ffast-math, so keep infinities out of
         * expf and clamp far-below-max logits to exactly 0. */
        double all_mass = 0.0;
        int64_t all_n = 0;
#pragma omp simd reduction(+ : all_mass, all_n)
        for (int64_t i = 0; i < vocab; i++) {
            const float d = (x[i] - m) * inv_t;
            const float e = expf(d > -87.f ? d : -87.f);
            p[i] = d > -87.f ? e : 0.f;
            all_mass += d > -87.f ? (double)e : 0.0;
            all_n += d > -87.f;
        }

        /* Banned tokens have p == 0 exactly: the smallest positive float keeps them out of every set
         * (every other p is at least exp(-87), a normal float, so the exp pass's sums are the kept set's). */
        float thr = min_p[r] > FLT_MIN ? min_p[r] : FLT_MIN; /* max p is exactly 1 */
        int64_t n = all_n;
        double kept = thr > FLT_MIN ? kept_mass(p, vocab, thr, &n) : all_mass;
        if (top_k[r] > 0 && top_k[r] < n) {
            if (top_k[r] <= TOPK_INSERT_MAX) {
                /* Small k: the k-th largest logit by a mostly-skipping insertion pass over x; p is monotone
                 * in x, so its p is the k-th largest p (and with more than k kept, it is a kept one). */
                int64_t *ids = (int64_t *)hist;
                topk_insert(x, vocab, top_k[r], work, ids);
                thr = p[ids[top_k[r] - 1]];
            } else {
                thr = kth_largest_hist(p, vocab, thr, top_k[r], work, hist);
            }
            kept = kept_mass(p, vocab, thr, &n);
        }
        if (top_p[r] < 1.f && n > 1) {
            const double excess = (1.0 - (double)top_p[r]) * kept;
            if (n <= TOPP_DIRECT_MAX) {
                /* A small kept set (after top_k or min_p): select on it directly, no histogram. */
                int64_t c = 0;
                for (int64_t i = 0; i < vocab; i++)
                    if (p[i] >= thr) work[c++] = p[i];
                thr = mass_threshold(work, c, excess);
            } else {
                thr = mass_threshold_hist(p, vocab, thr, excess, work, hist);
            }
            kept = kept_mass(p, vocab, thr, &n);
        }
        out[r] = draw(p, vocab, thr, u[r] * kept);
    }
}

/*
 * Logprobs of sampled positions in a few vectorised passes per row, instead of materialising
 * log_softmax over the vocabulary (64 rows x 49k entries cost ~12 ms through torch: log_softmax, a
 * comparison tensor for the rank, topk). Per requested row r (rows[r] of logits):
 *   lse        = log sum_i exp(x_i)                    (max-shifted)
 *   chosen     = x[chosen[r]] - lse
 *   rank       = #{i : x_i >= x[chosen[r]]}             (ties take the worse rank, as vLLM counts)
 *   top n[r]   = the n largest x_i - lse, largest first; among equal values the lower id first
 * Callers pass the raw model distribution (no infinities expected); far-below-max entries are clamped
 * out of expf as above.
 */
void logprobs_rows_f32(const float *logits, int64_t row_stride, const int64_t *rows, int64_t n, int64_t vocab,
                       const int64_t *chosen, const int64_t *num_top, int64_t max_top, float *out_chosen,
                       int64_t *out_rank, int64_t *out_top_ids, float *out_top_lp, int num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t r = 0; r < n; r++) {
        const float *x = logits + rows[r] * row_stride;
        const float c = x[chosen[r]];
        float m = x[0];
        int64_t rank = 0;
#pragma omp simd reduction(max : m) reduction(+ : rank)
        for (int64_t i = 0; i < vocab; i++) {
            m = x[i] > m ? x[i] : m;
            rank += x[i] >= c;
        }
        /* float partial sums (one per SIMD lane, as torch's log_softmax accumulates): the exp pass is
         * the row's only transcendental work, and a double accumulator halves its vector width. */
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < vocab; i++) {
            const float d = x[i] - m;
            s += d > -87.f ? expf(d) : 0.f;
        }
        const float lse = m + logf(s);
        out_chosen[r] = c - lse;
        out_rank[r] = rank;
        const int64_t k = num_top[r] < vocab ? num_top[r] : vocab;
        int64_t *ids = out_top_ids + r * max_top;
        float *vals = out_top_lp + r * max_top;
        if (k > 0) topk_insert(x, vocab, k, vals, ids);
        for (int64_t j = 0; j < k; j++) vals[j] -= lse;
    }
}

/* Guided decoding: set to -inf the logits a row's bitmask forbids (bit t % 32 of word t / 32 clear). Row r of
   the mask belongs to logits row rows[r]; vocab may end mid-word, and ids past the mask's words are forbidden. */
void apply_token_bitmask_f32(float *logits, int64_t ld, const int64_t *rows, int64_t nrows, const int32_t *mask,
                             int64_t words, int64_t vocab) {
    for (int64_t r = 0; r < nrows; r++) {
        float *x = logits + rows[r] * ld;
        const uint32_t *m = (const uint32_t *)(mask + r * words);
        for (int64_t w = 0; w < words && w * 32 < vocab; w++) {
            uint32_t bits = m[w];
            if (bits == 0xffffffffu) continue;
            int64_t base = w * 32, end = base + 32 < vocab ? base + 32 : vocab;
            for (int64_t t = base; t < end; t++)
                if (!((bits >> (t - base)) & 1u)) x[t] = -INFINITY;
        }
        for (int64_t t = words * 32; t < vocab; t++) x[t] = -INFINITY;
    }
}
