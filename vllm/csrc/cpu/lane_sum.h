/* The sum of a vector's float32 lanes, for the kernels' AVX2 loops (AVX-512 has
 * _mm512_reduce_add_ps). */
#ifndef VLLM_LANE_SUM_H
#define VLLM_LANE_SUM_H

#ifdef __AVX2__
#include <immintrin.h>

static inline float sum_x8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#endif
