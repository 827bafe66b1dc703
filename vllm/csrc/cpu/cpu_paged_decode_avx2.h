/* Part of cpu_paged_decode.c: attend_bf16's and attend_f32's copy for head_dim 64 where AVX2
 * with FMA is the widest ISA with a copy (HAVE_ATTEND_AVX2: no AVX512-BF16 copies built).
 * attend_bf16 sums each score's 64 products in one vector and then across its lanes, one score
 * at a time; here each key's products with a head stay a vector of 8 partial sums until 8 keys'
 * are reduced together (sum8). The value sums of up to AVX2_HEADS heads stay in registers
 * through a tile, 16 dims at a time; a bf16 value's 16 dims come from one load as its even and
 * its odd dims (a shift and a mask), and its sums keep that order until the task stores them
 * (dims_in_order). Each dim's sum takes one FMA per key, in the keys' order.
 *
 * A tile's rows are read with plain loads, row after row, before it is computed (touch_rows):
 * on the AVX2-only EPYC that is faster than load_tile, the other copies' burst of prefetches
 * into L2 followed by the same loads (benchmarks/benchmark_decode_attention.py). */
#ifndef VLLM_CPU_PAGED_DECODE_AVX2_H
#define VLLM_CPU_PAGED_DECODE_AVX2_H

#if !defined(HAVE_ATTEND_FAST) && defined(__AVX2__) && defined(__FMA__)
#define HAVE_ATTEND_AVX2 1
#include <immintrin.h>

#define AVX2_HEAD_DIM 64
#define AVX2_VECTORS (AVX2_HEAD_DIM / 8)
#define AVX2_HEADS 4  /* query heads of a KV head scored per pass over the tile's keys */

/* Lane i of the result = the sum of the 8 lanes of v[i]. */
static inline __m256 sum8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* a: lanes 0-3 the low halves' sums of v[0..3], 4-7 their high halves'; b the same of v[4..7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* A cache row's head (64 bf16, or float32 where f32) -> 8 vectors of float32. */
static inline __attribute__((always_inline)) void load_head64(const void *row, const int f32, __m256 v[AVX2_VECTORS]) {
    for (int j = 0; j < AVX2_VECTORS; ++j)
        v[j] = f32 ? _mm256_loadu_ps((const float *)row + 8 * j) : bf16x8_to_float((const uint16_t *)row + 8 * j);
}

/* A head's value sums from their order here (in each run of 16 dims, its 8 even dims, then
 * its 8 odd ones: add_values16's) into the dims' order. */
static inline void dims_in_order(float *acc) {
    for (int d0 = 0; d0 < AVX2_HEAD_DIM; d0 += 16) {
        const __m256 even = _mm256_load_ps(acc + d0), odd = _mm256_load_ps(acc + d0 + 8);
        const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
        /* lo: dims 0-3 | 8-11 of the run, hi: 4-7 | 12-15 */
        _mm256_store_ps(acc + d0, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_store_ps(acc + d0 + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
}

/* Heads h0 .. h0 + heads - 1, dims d0 .. d0 + 15 (bf16: even, then odd): += the tile's n
 * weighted values of KV head g, key after key (heads and f32 constants in each caller). */
static inline __attribute__((always_inline)) void add_values16(float acc[][MAX_HEAD_DIM], float scores[][TILE],
                                                               const char *const *value_rows, int64_t n, int64_t g,
                                                               int64_t h0, const int heads, int d0, const int f32) {
    const __m256i odd_bits = _mm256_set1_epi32((int32_t)0xffff0000);
    __m256 sum[AVX2_HEADS][2];
    for (int c = 0; c < heads; ++c)
        for (int j = 0; j < 2; ++j) sum[c][j] = _mm256_load_ps(acc[h0 + c] + d0 + 8 * j);
    for (int64_t i = 0; i < n; ++i) {
        __m256 v[2];
        if (f32) {
            const float *row = (const float *)value_rows[i] + g * AVX2_HEAD_DIM + d0;
            v[0] = _mm256_loadu_ps(row);
            v[1] = _mm256_loadu_ps(row + 8);
        } else {
            const __m256i pairs = _mm256_loadu_si256((const __m256i *)((const uint16_t *)value_rows[i] +
                                                                       g * AVX2_HEAD_DIM + d0));
            v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));     /* the even dims */
            v[1] = _mm256_castsi256_ps(_mm256_and_si256(pairs, odd_bits));  /* the odd ones */
        }
        for (int c = 0; c < heads; ++c) {
            const __m256 p = _mm256_broadcast_ss(&scores[h0 + c][i]);
            sum[c][0] = _mm256_fmadd_ps(p, v[0], sum[c][0]);
            sum[c][1] = _mm256_fmadd_ps(p, v[1], sum[c][1]);
        }
    }
    for (int c = 0; c < heads; ++c)
        for (int j = 0; j < 2; ++j) _mm256_store_ps(acc[h0 + c] + d0 + 8 * j, sum[c][j]);
}

/* attend_bf16, or where f32 attend_f32 (their arguments and result), for head_dim 64. */
static inline __attribute__((always_inline)) void attend_avx2_d64(
        const void *query, const void *key_cache, const void *value_cache, const int64_t *table, int64_t first,
        int64_t last, float *partial, int64_t num_heads, int64_t group, int64_t num_kv_heads, int64_t block_size,
        float scale, const int f32) {
    float q[MAX_HEADS][AVX2_HEAD_DIM] __attribute__((aligned(32)));
    float acc[MAX_HEADS][MAX_HEAD_DIM] __attribute__((aligned(32)));  /* dims as add_values16 keeps them */
    float scores[MAX_HEADS][TILE], running_max[MAX_HEADS], total[MAX_HEADS];
    __m256 products[AVX2_HEADS][TILE];  /* per head of a group's chunk, 8 partial sums per key */
    const char *key_rows[TILE], *value_rows[TILE];
    const int64_t row_stride = num_kv_heads * AVX2_HEAD_DIM;  /* one cache row: all KV heads */
    const int64_t element = f32 ? (int64_t)sizeof(float) : (int64_t)sizeof(uint16_t);
    const int64_t row_bytes = row_stride * element;
    for (int64_t h = 0; h < num_heads; ++h) {
        for (int64_t d = 0; d < AVX2_HEAD_DIM; ++d) {
            const int64_t i = h * AVX2_HEAD_DIM + d;
            q[h][d] = (f32 ? ((const float *)query)[i] : bf16_to_float(((const uint16_t *)query)[i])) * scale;
            acc[h][d] = 0.0f;
        }
        running_max[h] = -INFINITY;
        total[h] = 0.0f;
    }
    for (int64_t t0 = first; t0 < last; t0 += TILE) {
        const int64_t n = tile_row_pointers(table, t0, last, block_size, (const char *)key_cache,
                                            (const char *)value_cache, row_bytes, key_rows, value_rows);
        touch_rows(key_rows, value_rows, n, row_bytes);
        for (int64_t g = 0; g < num_kv_heads; ++g) {
            for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += AVX2_HEADS) {
                const int64_t heads = (g + 1) * group - h0 < AVX2_HEADS ? (g + 1) * group - h0 : AVX2_HEADS;
                for (int64_t i = 0; i < n; ++i) {  /* a key converted once, scored for its heads */
                    __m256 k[AVX2_VECTORS];
                    load_head64(key_rows[i] + g * AVX2_HEAD_DIM * element, f32, k);
                    for (int64_t c = 0; c < heads; ++c) {
                        const float *qh = q[h0 + c];
                        __m256 even = _mm256_mul_ps(_mm256_load_ps(qh), k[0]);
                        __m256 odd = _mm256_mul_ps(_mm256_load_ps(qh + 8), k[1]);
                        for (int j = 2; j < AVX2_VECTORS; j += 2) {
                            even = _mm256_fmadd_ps(_mm256_load_ps(qh + 8 * j), k[j], even);
                            odd = _mm256_fmadd_ps(_mm256_load_ps(qh + 8 * j + 8), k[j + 1], odd);
                        }
                        products[c][i] = _mm256_add_ps(even, odd);
                    }
                }
                for (int64_t c = 0; c < heads; ++c) {
                    float *out = scores[h0 + c];
                    for (int64_t i = 0; i < n; i += 8) {  /* a short last group: its keys' sums alone */
                        if (n - i >= 8) {
                            _mm256_storeu_ps(out + i, sum8(products[c] + i));
                            continue;
                        }
                        __m256 last[8];
                        float sums[8];
                        for (int j = 0; j < 8; ++j) last[j] = i + j < n ? products[c][i + j] : _mm256_setzero_ps();
                        _mm256_storeu_ps(sums, sum8(last));
                        memcpy(out + i, sums, (size_t)(n - i) * sizeof *sums);
                    }
                }
            }
        }
        softmax_tile(scores, n, num_heads, running_max, total, acc, AVX2_HEAD_DIM);
        for (int64_t g = 0; g < num_kv_heads; ++g)
            for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += AVX2_HEADS) {
                const int64_t heads = (g + 1) * group - h0 < AVX2_HEADS ? (g + 1) * group - h0 : AVX2_HEADS;
                for (int d0 = 0; d0 < AVX2_HEAD_DIM; d0 += 16) {
                    switch (heads) {
                    case 1: add_values16(acc, scores, value_rows, n, g, h0, 1, d0, f32); break;
                    case 2: add_values16(acc, scores, value_rows, n, g, h0, 2, d0, f32); break;
                    case 3: add_values16(acc, scores, value_rows, n, g, h0, 3, d0, f32); break;
                    default: add_values16(acc, scores, value_rows, n, g, h0, AVX2_HEADS, d0, f32); break;
                    }
                }
            }
    }
    for (int64_t h = 0; h < num_heads && !f32; ++h) dims_in_order(acc[h]);
    store_partial(partial, acc, running_max, total, num_heads, AVX2_HEAD_DIM);
}
#endif

#endif  /* VLLM_CPU_PAGED_DECODE_AVX2_H */
