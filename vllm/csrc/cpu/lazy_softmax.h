/* The online softmax of the AMX attention kernels, 16 rows of scores at a time in the lanes of
 * AVX512 vectors (for the C kernels beside it).
 *
 * Each lane is one row of the softmax (a query, or a query head). Scores come in 16-lane rows,
 * one per key; the weights leave as bf16 pairs of keys, the layout of an AMX operand tile
 * (pairs of keys x lanes), or as float32 rows for FMAs. The running maximum is raised only
 * when a score exceeds it by more than 2^MAX_GROWTH in weight, so the usual rescaling of the
 * sums at every step is skipped and the unnormalized weights stay below 2^MAX_GROWTH; and a
 * step's weights are first computed against the maximum as it stands, which most steps keep
 * (lazy_softmax_accept).
 */
#ifndef VLLM_LAZY_SOFTMAX_H
#define VLLM_LAZY_SOFTMAX_H

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define VLLM_HAVE_LAZY_SOFTMAX 1

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define MAX_GROWTH 8.0f /* log2 of how far weights may exceed 1 before a rescale */

/* 2^x in the lanes of `keep`, 0 in the others (whatever x holds there, even NaN): vreduceps
 * gives f = x - floor(x) in [0, 1), a cubic fitted to its relative error gives 2^f (at most
 * 7.5e-5, far below the bf16 rounding the weights get next), and scalef multiplies by
 * 2^floor(x) itself: two instructions fewer than rounding x and subtracting, on the inner loop
 * of every kernel that includes this. */
static inline __m512 exp2_masked(__mmask16 keep, __m512 x) {
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF);
    __m512 p = _mm512_set1_ps(7.802429e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.2606728e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9583361e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999252e-1f));
    return _mm512_maskz_scalef_ps(keep, p, x);
}

/* Per lane: the running maximum of its scores (raw, before the scale), and the total of its
 * weights 2^((score - max) * scale * log2 e). */
struct lazy_softmax {
    __m512 max, total, log2e_scale;
};

static inline struct lazy_softmax lazy_softmax_start(float scale) {
    return (struct lazy_softmax){_mm512_set1_ps(-INFINITY), _mm512_setzero_ps(),
                                 _mm512_set1_ps(scale * 1.44269504f)};
}

/* The maximum over the kept lanes of `rows` score rows (-inf in lanes that keep none). */
static inline __m512 masked_max(const float (*s)[16], const __mmask16 *keep, int rows) {
    /* Four partial maxima: one chain of dependent maxima would bound the loop. */
    __m512 m[4] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                   _mm512_set1_ps(-INFINITY)};
    for (int j = 0; j < rows; ++j) m[j % 4] = _mm512_mask_max_ps(m[j % 4], keep[j], m[j % 4], _mm512_load_ps(s[j]));
    return _mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3]));
}

/* Raises the maximum of the lanes where step_max exceeds it too far, and only those: a lane's
 * maximum, and so its weights' rounding, never depends on the other lanes (a query's attention
 * is the same whichever queries share its task, so it does not depend on where a prefill was cut
 * into chunks). Returns 0 if no lane changed; else 1, with *alpha the factor for each lane's
 * earlier sums, exactly 1 in the lanes kept (the totals are done). */
static inline int lazy_softmax_raise(struct lazy_softmax *st, __m512 step_max, __m512 *alpha) {
    const __m512 c = st->log2e_scale;
    const __mmask16 raised = _mm512_cmp_ps_mask(_mm512_mul_ps(step_max, c),
                                                _mm512_fmadd_ps(st->max, c, _mm512_set1_ps(MAX_GROWTH)), _CMP_GT_OQ);
    if (!raised) return 0;
    const __m512 new_max = _mm512_mask_mov_ps(st->max, raised, step_max);
    /* Lanes that have seen no score yet keep zero sums: their factor is irrelevant. */
    const __mmask16 finite = _mm512_cmp_ps_mask(st->max, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m512 factor = exp2_masked(finite, _mm512_mul_ps(_mm512_sub_ps(st->max, new_max), c));
    *alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), raised, factor);
    st->total = _mm512_mul_ps(st->total, *alpha);
    st->max = new_max;
    return 1;
}

/* Weights of `rows` (even) score rows against the running maximum as it stands, 0 outside
 * `keep`, stored as bf16 pairs: lane i of pairs[j] = the weights of rows 2j and 2j + 1 in lane
 * i. Returns their sum in each lane, for lazy_softmax_accept (not yet in the totals). */
static inline __m512 lazy_softmax_pairs(const struct lazy_softmax *st, const float (*s)[16], const __mmask16 *keep,
                                        int rows, uint32_t (*pairs)[16]) {
    /* Interleaves two rows of 16 bf16 into 16 pairs. */
    const __m512i pair_order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512 c = st->log2e_scale, scaled_max = _mm512_mul_ps(st->max, c);
    __m512 sums[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int j = 0; j < rows; j += 2) {
        const __m512 p0 = exp2_masked(keep[j], _mm512_fmsub_ps(_mm512_load_ps(s[j]), c, scaled_max));
        const __m512 p1 = exp2_masked(keep[j + 1], _mm512_fmsub_ps(_mm512_load_ps(s[j + 1]), c, scaled_max));
        sums[j / 2 % 2] = _mm512_add_ps(sums[j / 2 % 2], _mm512_add_ps(p0, p1));
        const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(p1, p0); /* p0 in lanes 0-15 */
        _mm512_store_si512(pairs[j / 2], _mm512_permutexvar_epi16(pair_order, pair));
    }
    return _mm512_add_ps(sums[0], sums[1]);
}

/* The same weights as float32 rows (weights[j] lane i: row j's weight in lane i), for products
 * on the vector units, where float32 FMAs outrun bf16 dot products. Returns their sums. */
static inline __m512 lazy_softmax_rows(const struct lazy_softmax *st, const float (*s)[16], const __mmask16 *keep,
                                       int rows, float (*weights)[16]) {
    const __m512 c = st->log2e_scale, scaled_max = _mm512_mul_ps(st->max, c);
    __m512 sums[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int j = 0; j < rows; ++j) {
        const __m512 p = exp2_masked(keep[j], _mm512_fmsub_ps(_mm512_load_ps(s[j]), c, scaled_max));
        sums[j % 2] = _mm512_add_ps(sums[j % 2], p);
        _mm512_store_ps(weights[j], p);
    }
    return _mm512_add_ps(sums[0], sums[1]);
}

/* A step's weights, computed against the maximum as it stands, stand if no lane's sum exceeds
 * 2^MAX_GROWTH, for then no weight does: the sums go into the totals and it returns 1. Else (a
 * larger score, or the first step, whose maximum is -inf: its sums are inf) it returns 0, and
 * the caller finds the step's maximum (masked_max), raises the running one (lazy_softmax_raise),
 * rescales what it has summed, and computes the weights again, adding their sums itself. Most
 * steps so read their scores once (for the weights) instead of twice (for the maximum, then for
 * the weights). */
static inline int lazy_softmax_accept(struct lazy_softmax *st, __m512 sums) {
    if (_mm512_cmp_ps_mask(sums, _mm512_set1_ps(exp2f(MAX_GROWTH)), _CMP_NLE_UQ)) return 0; /* or NaN */
    st->total = _mm512_add_ps(st->total, sums);
    return 1;
}

#endif
#endif
