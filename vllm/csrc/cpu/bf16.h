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

#ifdef __AVX2__
#include <immintrin.h>

static inline __m256 bf16x8_to_float(const uint16_t *x) {  /* 8 bf16 -> float32, exactly */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)x)), 16));
}

/* float_to_bf16 on 8 lanes: each lane's bf16 in its low 16 bits. */
static inline __m256i bf16x8_bits(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, nan);
}

static inline void store_bf16x8(uint16_t *y, __m256 x) {  /* 8 float32 -> bf16, nearest even */
    const __m256i b = bf16x8_bits(x);  /* each lane <= 0xffff: the unsigned pack keeps it */
    _mm_storeu_si128((__m128i *)y, _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
#endif

#endif
