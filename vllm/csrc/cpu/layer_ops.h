/* The element-wise steps of a Llama decoder layer on bf16 rows, rounded where torch's eager
 * bf16 ops round, for the C kernels beside it. */
#ifndef VLLM_LAYER_OPS_H
#define VLLM_LAYER_OPS_H

#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "exp.h"

static inline uint16_t round_bf16(float x) { return float_to_bf16(x); }
static inline float mul_bf16(uint16_t a, uint16_t b) { return bf16_to_float(a) * bf16_to_float(b); }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define VLLM_LAYER_OPS_X16 1
#include <immintrin.h>

/* Each step below also has a loop over 16 lanes, bf16 rounding at the same points (a scalar
 * tail takes the rest); GCC does not vectorize the scalar rounding by itself. */
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
#endif

/* torch: w * (x.float() * rsqrt(mean(x^2) + eps)).to(bf16), rounded after each of the two
 * products. The float32 sum's order is not torch's: rarely, an element differs by one unit. */
static inline void rms_norm_row(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t n, float eps) {
    float sum = 0.0f;
    int64_t i = 0;
#ifdef VLLM_LAYER_OPS_X16
    __m512 squares = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 v = bf16x16_to_float(x + i);
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    sum = _mm512_reduce_add_ps(squares);
#endif
    for (; i < n; ++i) sum += bf16_to_float(x[i]) * bf16_to_float(x[i]);
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    i = 0;
#ifdef VLLM_LAYER_OPS_X16
    for (; i + 16 <= n; i += 16) {
        const __m512 normed = round_bf16x16(_mm512_mul_ps(bf16x16_to_float(x + i), _mm512_set1_ps(inv)));
        store_bf16x16(y + i, _mm512_mul_ps(bf16x16_to_float(w + i), normed));
    }
#endif
    for (; i < n; ++i)
        y[i] = round_bf16(bf16_to_float(w[i]) * bf16_to_float(round_bf16(bf16_to_float(x[i]) * inv)));
}

/* One head: torch's x * cos + roll(x, D/2) * signed_sin, each product and the sum rounded to bf16. */
static inline void rotate(const uint16_t *x, const uint16_t *cos, const uint16_t *sin, uint16_t *y, int64_t d) {
    const int64_t half = d / 2;
    int64_t i = 0;
#ifdef VLLM_LAYER_OPS_X16
    if (half % 16 == 0)  /* each 16 lanes' partners are 16 lanes of the other half */
        for (; i < d; i += 16) {
            const uint16_t *partner = i < half ? x + i + half : x + i - half;
            const __m512 a = round_bf16x16(_mm512_mul_ps(bf16x16_to_float(x + i), bf16x16_to_float(cos + i)));
            const __m512 b = round_bf16x16(_mm512_mul_ps(bf16x16_to_float(partner), bf16x16_to_float(sin + i)));
            store_bf16x16(y + i, _mm512_add_ps(a, b));
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
#ifdef VLLM_LAYER_OPS_X16
    for (; i + 16 <= count; i += 16)
        store_bf16x16(hidden + i, _mm512_add_ps(bf16x16_to_float(hidden + i), bf16x16_to_float(delta + i)));
#endif
    for (; i < count; ++i) hidden[i] = round_bf16(bf16_to_float(hidden[i]) + bf16_to_float(delta[i]));
}

/* torch: silu(gate) * up, each rounded to bf16; gate_up (rows, 2 n) holds gate then up. */
static inline void silu_mul_row(const uint16_t *gate_up, uint16_t *out, int64_t n) {
    int64_t i = 0;
#ifdef VLLM_LAYER_OPS_X16
    for (; i + 16 <= n; i += 16) {
        const __m512 act = round_bf16x16(silu_x16(bf16x16_to_float(gate_up + i)));
        store_bf16x16(out + i, _mm512_mul_ps(act, bf16x16_to_float(gate_up + n + i)));
    }
#endif
    for (; i < n; ++i)
        out[i] = round_bf16(mul_bf16(round_bf16(silu(bf16_to_float(gate_up[i]))), gate_up[n + i]));
}

#endif
