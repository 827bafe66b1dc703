/* bf16 <-> float32 for the C kernels beside it. */
#ifndef VLLM_BF16_H
#define VLLM_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    /* A select, not a branch, so loops over it vectorize; NaN stays a (quiet) NaN. */
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? (bits >> 16) | 0x40u : rounded);
}

#ifdef __AVX512F__
#include <immintrin.h>

static inline __m512 bf16x16_to_float(const uint16_t *x) {  /* 16 bf16 -> float32, exactly */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
}

#ifdef __AVX512BF16__
static inline void store_bf16x16(uint16_t *y, __m512 x) {  /* 16 float32 -> bf16, nearest even */
    _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(x));
}

/* The pair of bf16 at p in all 16 lanes, an operand of vdpbf16ps (which can take it as an
 * embedded broadcast from memory). */
static inline __m512bh broadcast_bf16_pair(const uint16_t *p) {
    uint32_t pair;
    memcpy(&pair, p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32((int)pair);
}
#endif
#endif

#endif
