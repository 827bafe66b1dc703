/* A vectorizable e^x for the C kernels beside it. */
#ifndef VLLM_EXP_H
#define VLLM_EXP_H

#include <stdint.h>
#include <string.h>

/* e^x for x <= 0, vectorizable (libm's expf is not without -ffast-math): 2^n * 2^f with
 * n = round(x / ln 2), |f| <= 1/2 and a degree-6 Taylor series for 2^f (relative error about
 * 1e-7, float32's own). Below -87 it returns ~1e-38 rather than 0. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504f;
    const float n = (t + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    const float f = (t - n) * 0.693147181f;          /* 2^(t - n) = e^f, |f| <= ln(2) / 2 */
    float p = 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#ifdef __AVX512F__
#include <immintrin.h>

/* exp_nonpositive on 16 lanes, the same steps (scalef takes the 2^n). */
static inline __m512 exp_nonpositive_x16(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147181f));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp_nonpositive on 8 lanes, the same steps. */
static inline __m256 exp_nonpositive_x8(__m256 x) {
    const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(1.44269504f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147181f));
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#endif

#endif
