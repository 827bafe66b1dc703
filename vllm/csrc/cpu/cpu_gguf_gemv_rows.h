/*
 * Part of cpu_gguf_gemv.c: the weight-stationary products' inner loops (gguf_matmul_float's
 * where AVX-512 or AVX2 with FMA is built, gguf_matmul_int8's where AVX2 is: HAVE_GGUF_INT8_ROWS,
 * on vpdpbusd where the ISA has it, else on AVX2's pair products): one weight row times up to
 * TILE rows of x while its blocks are in L1, Q4_K a super-block at a time, Q6_K a block of two
 * runs at a time.
 */
#ifndef VLLM_CPU_GGUF_GEMV_ROWS_H
#define VLLM_CPU_GGUF_GEMV_ROWS_H

#include <stdlib.h>

#include "bf16.h"
#include "cpu_gguf_gemv_blocks.h"
#include "lane_sum.h"

#define TILE 4   /* rows of x multiplied into a weight row per pass over it */

static inline void store(void *y, int bf16, int64_t index, float value) {
    if (bf16) ((uint16_t *)y)[index] = float_to_bf16(value);
    else ((float *)y)[index] = value;
}

/* bias[j] in float32 (bias in x's dtype, or NULL: none). */
static inline float bias_at(const void *bias, int bf16, int64_t j) {
    if (bias == NULL) return 0.0f;
    return bf16 ? bf16_to_float(((const uint16_t *)bias)[j]) : ((const float *)bias)[j];
}

/* x as float32: itself, or a widened copy of bf16 x that the caller frees. */
static const float *float_rows(const void *x, int bf16, int64_t count, float **owned) {
    *owned = NULL;
    if (!bf16) return (const float *)x;
    float *copy = malloc((size_t)count * sizeof *copy);
    if (copy == NULL) return NULL;
    for (int64_t i = 0; i < count; ++i) copy[i] = bf16_to_float(((const uint16_t *)x)[i]);
    return *owned = copy;
}

#ifdef __AVX512F__
static inline __attribute__((always_inline)) void row_float(
        const uint8_t *row, int type, const float *xf, float b0, void *y, int bf16, int64_t j,
        int64_t t0, int tm, int64_t n, int64_t k) {
    const int64_t nb = k / QK;
    __m512 acc[TILE];
    for (int t = 0; t < TILE; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512 lo, hi;
        dequantize_row_block16(row, b, type, &lo, &hi);
        for (int t = 0; t < tm; ++t) {
            const float *xt = xf + (t0 + t) * k + b * QK;
            acc[t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xt), acc[t]);
            acc[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xt + 16), acc[t]);
        }
    }
    for (int t = 0; t < tm; ++t) store(y, bf16, (t0 + t) * n + j, _mm512_reduce_add_ps(acc[t]) + b0);
}

/* row_float for Q4_K, a super-block at a time (its scales unpacked once for its 8 sub-blocks),
 * with tm a constant in each caller (the sums then stay in registers). */
static inline __attribute__((always_inline)) void rows_float_q4_k(
        const uint8_t *row, const float *xf, float b0, void *y, int bf16, int64_t j, int64_t t0, const int tm,
        int64_t n, int64_t k) {
    __m512 acc[TILE];
    for (int t = 0; t < tm; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += QK_K) {
        const uint8_t *sb = row + i / QK_K * block_bytes(TYPE_Q4_K);
        const struct q4_k_scales u = q4_k_scales(sb);
        for (int s = 0; s < 8; ++s) {
            __m512 lo, hi;
            q4_k_sub_block16(sb, &u, s, &lo, &hi);
            for (int t = 0; t < tm; ++t) {
                const float *xt = xf + (t0 + t) * k + i + s * QK;
                acc[t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xt), acc[t]);
                acc[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xt + 16), acc[t]);
            }
        }
    }
    for (int t = 0; t < tm; ++t) store(y, bf16, (t0 + t) * n + j, _mm512_reduce_add_ps(acc[t]) + b0);
}

static void row_float_q4_k(const uint8_t *row, const float *xf, float b0, void *y, int bf16, int64_t j,
                           int64_t t0, int tm, int64_t n, int64_t k) {
    switch (tm) {
    case 1: rows_float_q4_k(row, xf, b0, y, bf16, j, t0, 1, n, k); break;
    case 2: rows_float_q4_k(row, xf, b0, y, bf16, j, t0, 2, n, k); break;
    case 3: rows_float_q4_k(row, xf, b0, y, bf16, j, t0, 3, n, k); break;
    default: rows_float_q4_k(row, xf, b0, y, bf16, j, t0, TILE, n, k); break;
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
/* row_float 8 lanes at a time: two sums per row of x (a block's vectors 0, 2 and 1, 3), so that
 * a single row's multiply-adds are not one chain. tm is a constant in each caller. */
static inline __attribute__((always_inline)) void rows_float8(
        const uint8_t *row, int type, const float *xf, float b0, void *y, int bf16, int64_t j,
        int64_t t0, const int tm, int64_t n, int64_t k) {
    const int64_t nb = k / QK;
    __m256 acc[TILE][2];
    for (int t = 0; t < tm; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m256 w[4];
        dequantize_row_block8(row, b, type, w);
        for (int t = 0; t < tm; ++t) {
            const float *xt = xf + (t0 + t) * k + b * QK;
            for (int v = 0; v < 4; ++v) acc[t][v % 2] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(xt + 8 * v), acc[t][v % 2]);
        }
    }
    for (int t = 0; t < tm; ++t)
        store(y, bf16, (t0 + t) * n + j, sum_x8(_mm256_add_ps(acc[t][0], acc[t][1])) + b0);
}

/* `type` is a constant in each caller. */
static inline __attribute__((always_inline)) void row_float(
        const uint8_t *row, int type, const float *xf, float b0, void *y, int bf16, int64_t j, int64_t t0, int tm,
        int64_t n, int64_t k) {
    switch (tm) {
    case 1: rows_float8(row, type, xf, b0, y, bf16, j, t0, 1, n, k); break;
    case 2: rows_float8(row, type, xf, b0, y, bf16, j, t0, 2, n, k); break;
    case 3: rows_float8(row, type, xf, b0, y, bf16, j, t0, 3, n, k); break;
    default: rows_float8(row, type, xf, b0, y, bf16, j, t0, TILE, n, k); break;
    }
}

/* Q4_K dequantizes a sub-block at a time here, its super-block's scales unpacked for each. */
static void row_float_q4_k(const uint8_t *row, const float *xf, float b0, void *y, int bf16, int64_t j,
                           int64_t t0, int tm, int64_t n, int64_t k) {
    row_float(row, TYPE_Q4_K, xf, b0, y, bf16, j, t0, tm, n, k);
}
#endif

#ifdef __AVX2__
#define HAVE_GGUF_INT8_ROWS 1

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD _mm256_dpbusd_epi32      /* sum of 4 u8 * s8 products into each int32 lane */
#elif defined(__AVXVNNI__)
#define DPBUSD _mm256_dpbusd_avx_epi32
#else
/* vpdpbusd's sums from AVX2's vpmaddubsw (u8 * s8 pairs summed into int16) and vpmaddwd. The
 * int16 sums saturate past 32767, which no operands here reach: the weights' unsigned codes are
 * at most 128 (|Q8_0 code|; 32 for Q6_K, 15 for the 4-bit types) and x's codes at most 127 in
 * magnitude, so a pair is at most 2 * 128 * 127 = 32512. */
static inline __m256i dpbusd_avx2(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#define DPBUSD dpbusd_avx2
#endif

/* Codes of one block of x: qx = round(x / dx), dx = max|x| / 127; *dxsx = dx * (sum of the codes),
 * what a block offset (Q4_1's m, Q4_K's minimums) multiplies. Returns the sum of the codes. */
static int32_t quantize_block(const float *x, int8_t *qx, float *dx, float *dxsx) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], magnitude));
    }
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_movehdup_ps(a));
    const float d = _mm_cvtss_f32(a) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    /* conversions round to nearest even, as nearbyintf does */
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    /* the packs interleave the four vectors' 128-bit halves: dword j of `bytes` holds codes
     * 8 (j % 4) + 4 (j / 4) .. + 3, which the permutation puts back in order */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)qx, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i sums = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    const int32_t sum = _mm_cvtsi128_si32(s);
    *dx = d;
    *dxsx = d * (float)sum;
    return sum;
}

/* The 32 codes of a weight block as bytes: unsigned nibbles (Q4_1) or signed (Q4_0, Q8_0). */
static inline __m256i weight_codes(const uint8_t *b, int type) {
    if (type == TYPE_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(b + (type == TYPE_Q4_1 ? 4 : 2)));
    const __m128i low = _mm_set1_epi8(15);
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
    return type == TYPE_Q4_0 ? _mm256_sub_epi8(q, _mm256_set1_epi8(8)) : q;
}

/* Weight block b of a row times block b of tm rows of quantized x, into acc[t] (the scaled dot
 * products) and shift[t] (Q4_1: m * dx * sum(qx)). type and tm are constants in each caller. */
static inline __attribute__((always_inline)) void block_int8(
        const uint8_t *row, int64_t b, const int type, const int8_t *qx, const float *dx, const float *dxsx,
        int64_t t0, int64_t nb, const int tm, __m256 *acc, float *shift) {
    const uint8_t *blk = row + b * block_bytes(type);
    const float dw = half_to_float(blk), mw = type == TYPE_Q4_1 ? half_to_float(blk + 2) : 0.0f;
    const __m256i q = weight_codes(blk, type);
    /* vpdpbusd multiplies unsigned by signed bytes: signed weight codes give their sign to x. */
    const __m256i wu = type == TYPE_Q4_1 ? q : _mm256_sign_epi8(q, q);
    for (int t = 0; t < tm; ++t) {
        const int64_t xb = (t0 + t) * nb + b;
        __m256i xs = _mm256_loadu_si256((const __m256i *)(qx + xb * QK));
        if (type != TYPE_Q4_1) xs = _mm256_sign_epi8(xs, q);
        const __m256i dot = DPBUSD(_mm256_setzero_si256(), wu, xs);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * dx[xb]), acc[t]);
        if (type == TYPE_Q4_1) shift[t] += mw * dxsx[xb];
    }
}

/* One weight row times tm rows of quantized x, two blocks at a time into two sets of sums (so
 * that a single row's multiply-adds are not one chain); type and tm are constants in each caller. */
static inline __attribute__((always_inline)) void rows_int8(
        const uint8_t *row, const int type, const int8_t *qx, const float *dx, const float *dxsx,
        float b0, void *y, int bf16, int64_t j, int64_t t0, const int tm, int64_t n, int64_t k) {
    const int64_t nb = k / QK;
    __m256 acc[2][TILE];
    float shift[2][TILE];
    for (int t = 0; t < tm; ++t) {
        acc[0][t] = acc[1][t] = _mm256_setzero_ps();
        shift[0][t] = shift[1][t] = 0.0f;
    }
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        block_int8(row, b, type, qx, dx, dxsx, t0, nb, tm, acc[0], shift[0]);
        block_int8(row, b + 1, type, qx, dx, dxsx, t0, nb, tm, acc[1], shift[1]);
    }
    if (b < nb) block_int8(row, b, type, qx, dx, dxsx, t0, nb, tm, acc[0], shift[0]);
    for (int t = 0; t < tm; ++t)
        store(y, bf16, (t0 + t) * n + j,
              sum_x8(_mm256_add_ps(acc[0][t], acc[1][t])) + (shift[0][t] + shift[1][t]) + b0);
}

/* rows_int8 with tm a constant in each instance (the sums then stay in registers). */
static inline __attribute__((always_inline)) void row_int8(
        const uint8_t *row, const int type, const int8_t *qx, const float *dx, const float *dxsx,
        float b0, void *y, int bf16, int64_t j, int64_t t0, int tm, int64_t n, int64_t k) {
    switch (tm) {
    case 1: rows_int8(row, type, qx, dx, dxsx, b0, y, bf16, j, t0, 1, n, k); break;
    case 2: rows_int8(row, type, qx, dx, dxsx, b0, y, bf16, j, t0, 2, n, k); break;
    case 3: rows_int8(row, type, qx, dx, dxsx, b0, y, bf16, j, t0, 3, n, k); break;
    default: rows_int8(row, type, qx, dx, dxsx, b0, y, bf16, j, t0, TILE, n, k); break;
    }
}

/* row_int8 for Q4_K, a super-block at a time (its scales unpacked once for its 8 sub-blocks,
 * each a Q4_1 block of scale d * sc_s and offset -dmin * m_s), with tm a constant in each caller
 * (the sums then stay in registers). */
static inline __attribute__((always_inline)) void rows_int8_q4_k(
        const uint8_t *row, const int8_t *qx, const float *dx, const float *dxsx, float b0, void *y, int bf16,
        int64_t j, int64_t t0, const int tm, int64_t n, int64_t k) {
    const int64_t nb = k / QK;
    __m256 acc[TILE];
    float shift[TILE];  /* sum over sub-blocks of -dmin * m_s * dx * sum(qx) */
    for (int t = 0; t < tm; ++t) {
        acc[t] = _mm256_setzero_ps();
        shift[t] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b += 8) {
        const uint8_t *sb = row + b / 8 * block_bytes(TYPE_Q4_K);
        const struct q4_k_scales u = q4_k_scales(sb);
        for (int s = 0; s < 8; ++s) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(sb + 16 + 32 * (s / 2)));
            const __m256i q = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(15));
            const float dw = q4_k_scale(&u, s), mw = q4_k_min(&u, s);
            for (int t = 0; t < tm; ++t) {
                const int64_t xb = (t0 + t) * nb + b + s;
                const __m256i dot = DPBUSD(_mm256_setzero_si256(), q, _mm256_loadu_si256((const __m256i *)(qx + xb * QK)));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * dx[xb]), acc[t]);
                shift[t] -= mw * dxsx[xb];
            }
        }
    }
    for (int t = 0; t < tm; ++t) store(y, bf16, (t0 + t) * n + j, sum_x8(acc[t]) + shift[t] + b0);
}

static void row_int8_q4_k(const uint8_t *row, const int8_t *qx, const float *dx, const float *dxsx, float b0,
                          void *y, int bf16, int64_t j, int64_t t0, int tm, int64_t n, int64_t k) {
    switch (tm) {
    case 1: rows_int8_q4_k(row, qx, dx, dxsx, b0, y, bf16, j, t0, 1, n, k); break;
    case 2: rows_int8_q4_k(row, qx, dx, dxsx, b0, y, bf16, j, t0, 2, n, k); break;
    case 3: rows_int8_q4_k(row, qx, dx, dxsx, b0, y, bf16, j, t0, 3, n, k); break;
    default: rows_int8_q4_k(row, qx, dx, dxsx, b0, y, bf16, j, t0, TILE, n, k); break;
    }
}

/* The signed codes q_i - 32 of block j of a Q6_K half super-block, as bytes, from the half's
 * low-bit bytes ql (two vectors: bytes 0-31 and 32-63) and high-bit bytes qh. The shifts act on
 * 16-bit lanes; the masks keep each byte's own bits. j is a constant in each caller. */
static inline __attribute__((always_inline)) __m256i q6_k_codes(const __m256i ql[2], __m256i qh, const int j) {
    const __m256i l = ql[j % 2];
    const __m256i low = _mm256_and_si256(j < 2 ? l : _mm256_srli_epi16(l, 4), _mm256_set1_epi8(15));
    /* bits 2 j and 2 j + 1 of qh to bits 4 and 5 */
    const __m256i high = j == 0 ? _mm256_slli_epi16(qh, 4) : j == 1 ? _mm256_slli_epi16(qh, 2)
                       : j == 2 ? qh : _mm256_srli_epi16(qh, 2);
    return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x30))),
                           _mm256_set1_epi8(32));
}

/* Block j of a Q6_K half super-block (its code bytes ql, qh; d * sc_r of its two runs in
 * `scale`) times the quantized x of tm rows (x block xb0 of the first, nb apart) into acc: a
 * block's 8 int32 lanes of dot products are its first run's (lanes 0-3) and its second's (4-7).
 * j and tm are constants in each caller. */
static inline __attribute__((always_inline)) void q6_k_block_rows(
        const __m256i ql[2], __m256i qh, const int j, __m256 scale, const int8_t *qx, const float *dx,
        int64_t xb0, int64_t nb, const int tm, __m256 *acc) {
    const __m256i codes = q6_k_codes(ql, qh, j);
    /* vpdpbusd multiplies unsigned by signed bytes: the signed codes give their sign to x. */
    const __m256i wu = _mm256_sign_epi8(codes, codes);
    for (int t = 0; t < tm; ++t) {
        const int64_t xb = xb0 + t * nb;
        const __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(qx + xb * QK)), codes);
        const __m256i dot = DPBUSD(_mm256_setzero_si256(), wu, xs);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(dx[xb])), acc[t]);
    }
}

/* row_int8 for Q6_K, a super-block at a time (its scale read once, each half's code bytes
 * loaded once for its 4 blocks), with tm a constant in each caller. */
static inline __attribute__((always_inline)) void rows_int8_q6_k(
        const uint8_t *row, const int8_t *qx, const float *dx, float b0, void *y, int bf16, int64_t j,
        int64_t t0, const int tm, int64_t n, int64_t k) {
    const int64_t nb = k / QK;
    __m256 acc[TILE];
    for (int t = 0; t < tm; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b += 8) {
        const uint8_t *sb = row + b / 8 * block_bytes(TYPE_Q6_K);
        const float d = half_to_float(sb + 208);
        const int8_t *sc = (const int8_t *)(sb + 192);
        for (int h = 0; h < 2; ++h) {
            const __m256i ql[2] = {_mm256_loadu_si256((const __m256i *)(sb + 64 * h)),
                                   _mm256_loadu_si256((const __m256i *)(sb + 64 * h + 32))};
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * h));
            for (int i = 0; i < 4; ++i) {  /* unrolled: i is then a constant for q6_k_codes' shifts */
                const __m256 scale = _mm256_set_m128(_mm_set1_ps(d * (float)sc[8 * h + 2 * i + 1]),
                                                     _mm_set1_ps(d * (float)sc[8 * h + 2 * i]));
                q6_k_block_rows(ql, qh, i, scale, qx, dx, t0 * nb + b + 4 * h + i, nb, tm, acc);
            }
        }
    }
    for (int t = 0; t < tm; ++t) store(y, bf16, (t0 + t) * n + j, sum_x8(acc[t]) + b0);
}

static void row_int8_q6_k(const uint8_t *row, const int8_t *qx, const float *dx, float b0, void *y, int bf16,
                          int64_t j, int64_t t0, int tm, int64_t n, int64_t k) {
    switch (tm) {
    case 1: rows_int8_q6_k(row, qx, dx, b0, y, bf16, j, t0, 1, n, k); break;
    case 2: rows_int8_q6_k(row, qx, dx, b0, y, bf16, j, t0, 2, n, k); break;
    case 3: rows_int8_q6_k(row, qx, dx, b0, y, bf16, j, t0, 3, n, k); break;
    default: rows_int8_q6_k(row, qx, dx, b0, y, bf16, j, t0, TILE, n, k); break;
    }
}
#endif

#endif  /* VLLM_CPU_GGUF_GEMV_ROWS_H */
