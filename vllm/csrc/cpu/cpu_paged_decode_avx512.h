/* Part of cpu_paged_decode.c: attend_bf16's copies on AVX512-BF16 dot products, one per group
 * size and head_dim (HAVE_ATTEND_FAST where the CPU has them). */
#ifndef VLLM_CPU_PAGED_DECODE_AVX512_H
#define VLLM_CPU_PAGED_DECODE_AVX512_H

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

/* Lane i of the result = the sum of the 16 lanes of v[i] (a transpose by halves, 45 ops for
 * 16 sums where reducing each vector alone takes about 8 each). */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int j = 0; j < 8; ++j)  /* per 128-bit lane: two vectors' partial sums, interleaved */
        w[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                             _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; ++j) {  /* per 128-bit lane: four vectors' sums over that lane */
        const __m512d c = _mm512_castps_pd(w[2 * j]), d = _mm512_castps_pd(w[2 * j + 1]);
        x[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
    }
    for (int j = 0; j < 2; ++j)  /* then across the four 128-bit lanes, in two halvings */
        y[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
}

/* The value pass takes the tile's weights as bf16 pairs of keys, as the prefill kernels do:
 * each vdpbf16ps adds two keys' values times their weights for 16 dims, where float32 FMAs add
 * one key's. The pairs of value rows are unpacked by words within 128-bit lanes, so the dims of
 * 32 land in two vectors in this order (lane l of each):
 *
 *   lo: dims 0-3 | 8-11 | 16-19 | 24-27        hi: dims 4-7 | 12-15 | 20-23 | 28-31
 *
 * and a task's value sums stay in that order until unpair_dims restores it. */

/* Each head's weights of keys 0 .. n - 1 as bf16, keys 2j and 2j + 1 in dword j. The scores
 * past n up to a multiple of 16 are 0 (scored as empty), so an odd n pairs its last key with
 * a weight of 0. */
static inline void weight_pairs(float scores[][TILE], int64_t n, int64_t num_heads, uint16_t pairs[][TILE]) {
    for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t i0 = 0; i0 < n; i0 += 16) store_bf16x16(&pairs[h][i0], _mm512_loadu_ps(&scores[h][i0]));
}

/* Value rows a and b (keys 2j and 2j + 1), dims d0 .. d0 + 31 -> lo and hi, lane l a pair
 * (a[d], b[d]) for the dims in the order above. */
static inline void value_pairs(const uint16_t *a, const uint16_t *b, __m512bh *lo, __m512bh *hi) {
    const __m512i va = _mm512_loadu_si512((const void *)a), vb = _mm512_loadu_si512((const void *)b);
    *lo = (__m512bh)_mm512_unpacklo_epi16(va, vb);
    *hi = (__m512bh)_mm512_unpackhi_epi16(va, vb);
}

/* A head's value sums (head_dim a multiple of 32) from the pairs' order back to dims 0, 1, ... */
static inline void unpair_dims(float *acc, int64_t head_dim) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
        const __m512 lo = _mm512_loadu_ps(acc + d0), hi = _mm512_loadu_ps(acc + d0 + 16);
        _mm512_storeu_ps(acc + d0, _mm512_permutex2var_ps(lo, first, hi));
        _mm512_storeu_ps(acc + d0 + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
}

/* Share `step` of `steps` of the rows of the tile ahead (n rows, row_bytes each, in both caches),
 * asked for into L2: rows [step * n / steps, (step + 1) * n / steps). */
static inline void prefetch_rows_share(const char *const *key_rows, const char *const *value_rows, int64_t n,
                                       int64_t step, int64_t steps, int64_t row_bytes) {
    prefetch_rows(key_rows, value_rows, step * n / steps, (step + 1) * n / steps, row_bytes);
}

/* attend_bf16 for G query heads per KV head and head_dim HD, on AVX512-BF16: a query-key
 * score is two or four bf16 dot-product instructions (exact products, float32 sums) and 16
 * scores are reduced together; the G heads' value sums stay in registers while a tile's values
 * are added in pairs of keys, each pair of value rows unpacked once for all G heads. */
#define DEFINE_ATTEND_FAST(G, HD)                                                                  \
static void attend_bf16_g##G##_d##HD(                                                              \
        const uint16_t *query, const uint16_t *key_cache, const uint16_t *value_cache,            \
        const int64_t *table, int64_t first, int64_t last, float *partial, int64_t num_heads,     \
        int64_t num_kv_heads, int64_t block_size, float scale) {                                  \
    enum { QC = HD / 32, AC = HD / 16 };                                                          \
    float acc[MAX_HEADS][MAX_HEAD_DIM], scores[MAX_HEADS][TILE], running_max[MAX_HEADS];          \
    float total[MAX_HEADS];                                                                       \
    uint16_t pairs[MAX_HEADS][TILE];                                                              \
    __m512bh q[MAX_HEADS][QC];                                                                    \
    const char *key_rows[TILE], *value_rows[TILE], *keys_ahead[TILE], *values_ahead[TILE];        \
    const int64_t row_stride = num_kv_heads * HD;                                                 \
    for (int64_t h = 0; h < num_heads; ++h) {                                                     \
        for (int c = 0; c < QC; ++c)                                                              \
            q[h][c] = (__m512bh)_mm512_loadu_si512((const void *)(query + h * HD + 32 * c));      \
        for (int64_t d = 0; d < HD; ++d) acc[h][d] = 0.0f;                                        \
        running_max[h] = -INFINITY;                                                               \
        total[h] = 0.0f;                                                                          \
    }                                                                                             \
    for (int64_t t0 = first; t0 < last; t0 += TILE) {                                             \
        const int64_t n = tile_rows(table, t0, last, block_size, (const char *)key_cache,         \
                                    (const char *)value_cache, row_stride * 2, key_rows, value_rows); \
        /* The next tile's rows are asked for while this one's scores are made, a share in each   \
         * pass (in one burst they would fill the miss queue and stall the loop), so that its     \
         * loads (load_tile) find them in L2. */                                                  \
        const int64_t n_ahead = tile_row_pointers(table, t0 + TILE, last, block_size, (const char *)key_cache, \
                                                  (const char *)value_cache, row_stride * 2, keys_ahead, \
                                                  values_ahead);                                   \
        for (int64_t h = 0; h < num_heads; ++h) {                                                 \
            const int64_t g = h / G;                                                              \
            for (int64_t i0 = 0; i0 < n; i0 += 16) {                                              \
                prefetch_rows_share(keys_ahead, values_ahead, n_ahead, h * (TILE / 16) + i0 / 16,  \
                                    num_heads * (TILE / 16), row_stride * 2);                     \
                __m512 part[16];                                                                  \
                for (int j = 0; j < 16; ++j) {                                                    \
                    part[j] = _mm512_setzero_ps();                                                \
                    if (i0 + j >= n) continue;                                                    \
                    const uint16_t *k = (const uint16_t *)key_rows[i0 + j] + g * HD;              \
                    for (int c = 0; c < QC; ++c)                                                  \
                        part[j] = _mm512_dpbf16_ps(part[j], q[h][c],                              \
                                                   (__m512bh)_mm512_loadu_si512((const void *)(k + 32 * c))); \
                }                                                                                 \
                _mm512_storeu_ps(&scores[h][i0], _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale))); \
            }                                                                                     \
        }                                                                                         \
        softmax_tile(scores, n, num_heads, running_max, total, acc, HD);                          \
        weight_pairs(scores, n, num_heads, pairs);                                                \
        for (int64_t g = 0; g < num_kv_heads; ++g) {                                              \
            __m512 sums[G][AC];                                                                   \
            for (int hh = 0; hh < G; ++hh)                                                        \
                for (int c = 0; c < AC; ++c) sums[hh][c] = _mm512_loadu_ps(&acc[g * G + hh][16 * c]); \
            for (int64_t i = 0; i < n; i += 2) {                                                  \
                const uint16_t *a = (const uint16_t *)value_rows[i] + g * HD;                     \
                const uint16_t *b = i + 1 < n ? (const uint16_t *)value_rows[i + 1] + g * HD : a; \
                __m512bh v[AC];                                                                   \
                for (int c = 0; c < AC; c += 2) value_pairs(a + 16 * c, b + 16 * c, &v[c], &v[c + 1]); \
                for (int hh = 0; hh < G; ++hh) {                                                  \
                    const __m512bh p = broadcast_bf16_pair(&pairs[g * G + hh][i]);                  \
                    for (int c = 0; c < AC; ++c) sums[hh][c] = _mm512_dpbf16_ps(sums[hh][c], v[c], p); \
                }                                                                                 \
            }                                                                                     \
            for (int hh = 0; hh < G; ++hh)                                                        \
                for (int c = 0; c < AC; ++c) _mm512_storeu_ps(&acc[g * G + hh][16 * c], sums[hh][c]); \
        }                                                                                         \
    }                                                                                             \
    for (int64_t h = 0; h < num_heads; ++h) unpair_dims(acc[h], HD);                              \
    store_partial(partial, acc, running_max, total, num_heads, HD);                               \
}

/* G * AC accumulators in registers: up to 16 of the 32 vector registers. */
DEFINE_ATTEND_FAST(1, 64)
DEFINE_ATTEND_FAST(2, 64)
DEFINE_ATTEND_FAST(3, 64)
DEFINE_ATTEND_FAST(4, 64)
DEFINE_ATTEND_FAST(1, 128)
DEFINE_ATTEND_FAST(2, 128)
#define HAVE_ATTEND_FAST 1
#endif

#endif
