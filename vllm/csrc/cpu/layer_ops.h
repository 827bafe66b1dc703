/* The element-wise steps of a Llama decoder layer on bf16 rows, rounded where torch's eager
 * bf16 ops round, and on float32 rows, for the C kernels beside it. */
#ifndef VLLM_LAYER_OPS_H
#define VLLM_LAYER_OPS_H

#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "exp.h"
#include "lane_sum.h"

static inline uint16_t round_bf16(float x) { return float_to_bf16(x); }
static inline float mul_bf16(uint16_t a, uint16_t b) { return bf16_to_float(a) * bf16_to_float(b); }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define VLLM_LAYER_OPS_X16 1
#include <immintrin.h>

static inline __m512 round_bf16x16(__m512 x) {  /* to the nearest bf16 (even on ties), kept in float32 */
    return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(x));
}

/* silu() on 16 lanes: 1 / (1 + e) from the 14-bit reciprocal and one Newton step (~1e-8
 * relative). */
static inline __m512 silu_x16(__m512 x) {
    const __m512 e = exp_nonpositive_x16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    const __m512 d = _mm512_add_ps(e, _mm512_set1_ps(1.0f));
    const __m512 r0 = _mm512_rcp14_ps(d);
    const __m512 r = _mm512_mul_ps(r0, _mm512_fnmadd_ps(d, r0, _mm512_set1_ps(2.0f)));
    const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mul_ps(x, _mm512_mask_mul_ps(r, negative, e, r));
}

#define LANES 16
typedef __m512 lanes_ps;
#define load_lanes bf16x16_to_float
#define store_lanes store_bf16x16
#define round_lanes round_bf16x16
#define silu_lanes silu_x16
#define mul_lanes _mm512_mul_ps
#define add_lanes _mm512_add_ps
#define fmadd_lanes _mm512_fmadd_ps
#define set1_lanes _mm512_set1_ps
#define sum_lanes _mm512_reduce_add_ps
#define loadf_lanes _mm512_loadu_ps
#define storef_lanes _mm512_storeu_ps

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 round_bf16x8(__m256 x) {  /* to the nearest bf16 (even on ties), kept in float32 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16x8_bits(x), 16));
}

/* silu() on 8 lanes, silu()'s steps (a true division). */
static inline __m256 silu_x8(__m256 x) {
    const __m256 e = exp_nonpositive_x8(_mm256_or_ps(x, _mm256_set1_ps(-0.0f)));  /* e^-|x| */
    const __m256 r = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f)));
    const __m256 negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    return _mm256_mul_ps(x, _mm256_blendv_ps(r, _mm256_mul_ps(e, r), negative));
}

#define LANES 8
typedef __m256 lanes_ps;
#define load_lanes bf16x8_to_float
#define store_lanes store_bf16x8
#define round_lanes round_bf16x8
#define silu_lanes silu_x8
#define mul_lanes _mm256_mul_ps
#define add_lanes _mm256_add_ps
#define fmadd_lanes _mm256_fmadd_ps
#define set1_lanes _mm256_set1_ps
#define sum_lanes sum_x8
#define loadf_lanes _mm256_loadu_ps
#define storef_lanes _mm256_storeu_ps
#endif

/* Each step below has a loop over the widest lanes built (LANES: 16 with AVX-512 BF16, 8 with
 * AVX2), rounding to bf16 at the same points as its scalar tail, which takes the rest; GCC
 * does not vectorize the scalar rounding by itself. */

/* torch: w * (x.float() * rsqrt(mean(x^2) + eps)).to(bf16), rounded after each of the two
 * products. The float32 sum's order is not torch's: rarely, an element differs by one unit. */
static inline void rms_norm_row(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t n, float eps) {
    float sum = 0.0f;
    int64_t i = 0;
#ifdef LANES
    lanes_ps squares = set1_lanes(0.0f);
    for (; i + LANES <= n; i += LANES) {
        const lanes_ps v = load_lanes(x + i);
        squares = fmadd_lanes(v, v, squares);
    }
    sum = sum_lanes(squares);
#endif
    for (; i < n; ++i) sum += bf16_to_float(x[i]) * bf16_to_float(x[i]);
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    i = 0;
#ifdef LANES
    for (; i + LANES <= n; i += LANES) {
        const lanes_ps normed = round_lanes(mul_lanes(load_lanes(x + i), set1_lanes(inv)));
        store_lanes(y + i, mul_lanes(load_lanes(w + i), normed));
    }
#endif
    for (; i < n; ++i)
        y[i] = round_bf16(bf16_to_float(w[i]) * bf16_to_float(round_bf16(bf16_to_float(x[i]) * inv)));
}

/* One head: torch's x * cos + roll(x, D/2) * signed_sin, each product and the sum rounded to bf16. */
static inline void rotate(const uint16_t *x, const uint16_t *cos, const uint16_t *sin, uint16_t *y, int64_t d) {
    const int64_t half = d / 2;
    int64_t i = 0;
#ifdef LANES
    if (half % LANES == 0)  /* each vector's partners are a vector of the other half */
        for (; i < d; i += LANES) {
            const uint16_t *partner = i < half ? x + i + half : x + i - half;
            const lanes_ps a = round_lanes(mul_lanes(load_lanes(x + i), load_lanes(cos + i)));
            const lanes_ps b = round_lanes(mul_lanes(load_lanes(partner), load_lanes(sin + i)));
            store_lanes(y + i, add_lanes(a, b));
        }
#endif
    for (; i < d; ++i) {
        const uint16_t partner = i < half ? x[i + half] : x[i - half];
        const float a = bf16_to_float(round_bf16(mul_bf16(x[i], cos[i])));
        const float b = bf16_to_float(round_bf16(mul_bf16(partner, sin[i])));
        y[i] = round_bf16(a + b);
    }
}

/* torch: x / (1 + e^-x) in float32; e^-|x| keeps the vectorizable exp's argument <= 0, and
 * for x < 0, x / (1 + e^-x) = x e^x / (1 + e^x). One division for both signs. */
static inline float silu(float x) {
    const float e = exp_nonpositive(-fabsf(x));
    const float r = 1.0f / (1.0f + e);
    return x * (x >= 0.0f ? r : e * r);
}

/* torch: hidden + delta, rounded to bf16. */
static inline void add_into(uint16_t *hidden, const uint16_t *delta, int64_t count) {
    int64_t i = 0;
#ifdef LANES
    for (; i + LANES <= count; i += LANES)
        store_lanes(hidden + i, add_lanes(load_lanes(hidden + i), load_lanes(delta + i)));
#endif
    for (; i < count; ++i) hidden[i] = round_bf16(bf16_to_float(hidden[i]) + bf16_to_float(delta[i]));
}

/* torch: silu(gate) * up, each rounded to bf16; gate_up (rows, 2 n) holds gate then up. */
static inline void silu_mul_row(const uint16_t *gate_up, uint16_t *out, int64_t n) {
    int64_t i = 0;
#ifdef LANES
    for (; i + LANES <= n; i += LANES) {
        const lanes_ps act = round_lanes(silu_lanes(load_lanes(gate_up + i)));
        store_lanes(out + i, mul_lanes(act, load_lanes(gate_up + n + i)));
    }
#endif
    for (; i < n; ++i)
        out[i] = round_bf16(mul_bf16(round_bf16(silu(bf16_to_float(gate_up[i]))), gate_up[n + i]));
}

/* The same steps on float32 rows, as torch's eager float32 ops compute them: no roundings between
 * the products and sums, the norm's sum of squares in another order, SiLU's exp within float32's
 * rounding. */

static inline void rms_norm_row_f32(const float *x, const float *w, float *y, int64_t n, float eps) {
    float sum = 0.0f;
    int64_t i = 0;
#ifdef LANES
    lanes_ps squares = set1_lanes(0.0f);
    for (; i + LANES <= n; i += LANES) {
        const lanes_ps v = loadf_lanes(x + i);
        squares = fmadd_lanes(v, v, squares);
    }
    sum = sum_lanes(squares);
#endif
    for (; i < n; ++i) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    i = 0;
#ifdef LANES
    for (; i + LANES <= n; i += LANES)
        storef_lanes(y + i, mul_lanes(loadf_lanes(w + i), mul_lanes(loadf_lanes(x + i), set1_lanes(inv))));
#endif
    for (; i < n; ++i) y[i] = w[i] * (x[i] * inv);
}

/* x * cos + roll(x, D/2) * signed_sin: two products, then their sum. */
static inline void rotate_f32(const float *x, const float *cos, const float *sin, float *y, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < d; ++i) {
        const float partner = i < half ? x[i + half] : x[i - half];
        const float a = x[i] * cos[i], b = partner * sin[i];
        y[i] = a + b;
    }
}

static inline void add_into_f32(float *hidden, const float *delta, int64_t count) {
    for (int64_t i = 0; i < count; ++i) hidden[i] += delta[i];
}

static inline void silu_mul_row_f32(const float *gate_up, float *out, int64_t n) {
    int64_t i = 0;
#ifdef LANES
    for (; i + LANES <= n; i += LANES)
        storef_lanes(out + i, mul_lanes(silu_lanes(loadf_lanes(gate_up + i)), loadf_lanes(gate_up + n + i)));
#endif
    for (; i < n; ++i) out[i] = silu(gate_up[i]) * gate_up[n + i];
}

#endif
