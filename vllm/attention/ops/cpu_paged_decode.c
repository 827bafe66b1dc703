/*
 * Decode attention on CPU that reads keys and values where they lie in the paged cache.
 *
 * Every sequence has one query token. Its keys are the first seq_len slots of its blocks:
 *
 *   block_tables[s] = [ 7 | 2 | 9 ]          block_size 4, seq_len 10
 *   key t           -> block block_tables[s][t / 4], row t % 4
 *   keys 0..9       = rows 0-3 of block 7, rows 0-3 of block 2, rows 0-1 of block 9
 *
 * One task per sequence attends all its heads with an online softmax over tiles of keys, and
 * prefetches the next tile's rows while it computes: no gather of the blocks, no padding to
 * the longest sequence, no mask. With fewer sequences than threads, a sequence's keys are
 * split over several tasks and the parts merged. Scores, softmax and the weighted sum of
 * values stay in float32. On SmolLM2's decodes (2-core AMX machine, 4 sequences of 2000 tokens, all 30
 * layers, cache not in CPU caches) it takes 18 ms where gathering the blocks for SDPA took 25.
 * bf16 caches with 1-4 query heads per KV head (head_dim 64) or 1-2 (head_dim 128) take a copy
 * on AVX512-BF16 dot products with the value sums in registers: 16 sequences of 280 keys, all
 * layers, 7.1 ms against 9.7 (3.4 against 6.4 with the cache in CPU caches). Where AMX is
 * there, bf16 with head_dim 64, at most 16 heads and 4 per KV head takes a third copy: the
 * scores of all heads as tile products, the values by bf16 dot products over pairs of keys, the
 * next rows prefetched (attend_bf16_amx); 4 sequences of 2030 keys, 30 layers, from memory:
 * ~11-13 ms against ~14.7.
 *
 * Layouts (all contiguous): query and out (num_seqs, num_heads, head_dim); caches
 * (num_blocks, block_size, num_kv_heads, head_dim); block_tables (num_seqs, max_blocks) and
 * seq_lens (num_seqs) int64. With window > 0 only the last `window` keys are attended.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "exp.h"
#include "lazy_softmax.h"
#include "paged_cache.h"

#define MAX_HEADS 64
#define MAX_HEAD_DIM 256
#define TILE 64         /* keys scored before one softmax update */

static inline float f32_to_float(float x) { return x; }
static inline float float_to_f32(float x) { return x; }

/* Cache slots of keys t0 .. t0 + n - 1 of a sequence, from its block table. */
static inline void tile_slots(const int64_t *table, int64_t t0, int64_t n, int64_t block_size,
                              int64_t *slots) {
    int64_t block = t0 / block_size, offset = t0 % block_size; /* of key t0 + i */
    for (int64_t i = 0; i < n; ++i) {
        slots[i] = table[block] * block_size + offset;
        if (++offset == block_size) {
            offset = 0;
            ++block;
        }
    }
}

/* Asks for the cache rows of keys t0 .. t0 + TILE - 1 (below last): computing the current tile
 * hides their memory latency. */
static inline void prefetch_tile(const int64_t *table, int64_t t0, int64_t last, int64_t block_size,
                                 const char *key_cache, const char *value_cache, int64_t row_bytes) {
    for (int64_t i = 0, t = t0; i < TILE && t < last; ++i, ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        for (int64_t b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch(key_cache + slot * row_bytes + b);
            __builtin_prefetch(value_cache + slot * row_bytes + b);
        }
    }
}

/* Online softmax over one tile: scores become weights relative to each head's new maximum,
 * and the running totals and value sums are rescaled to it. */
static inline void softmax_tile(float scores[][TILE], int64_t n, int64_t num_heads,
                                float *running_max, float *total, float acc[][MAX_HEAD_DIM],
                                int64_t head_dim) {
    for (int64_t h = 0; h < num_heads; ++h) {
        float new_max = running_max[h];
        _Pragma("omp simd reduction(max:new_max)")
        for (int64_t i = 0; i < n; ++i) new_max = scores[h][i] > new_max ? scores[h][i] : new_max;
        const float rescale = exp_nonpositive(running_max[h] - new_max);
        float sum = 0.0f;
        _Pragma("omp simd reduction(+:sum)")
        for (int64_t i = 0; i < n; ++i) {
            scores[h][i] = exp_nonpositive(scores[h][i] - new_max);
            sum += scores[h][i];
        }
        total[h] = total[h] * rescale + sum;
        for (int64_t d = 0; d < head_dim; ++d) acc[h][d] *= rescale;
        running_max[h] = new_max;
    }
}

/* A range's result for the merge: per head its unnormalized value sum, max and total weight. */
static inline void store_partial(float *partial, float acc[][MAX_HEAD_DIM], const float *running_max,
                                 const float *total, int64_t num_heads, int64_t head_dim) {
    for (int64_t h = 0; h < num_heads; ++h) {
        float *ph = partial + h * (head_dim + 2);
        for (int64_t d = 0; d < head_dim; ++d) ph[d] = acc[h][d];
        ph[head_dim] = running_max[h];
        ph[head_dim + 1] = total[h];
    }
}

/* Keys [first, last) of one sequence, all its heads. A tile's cache rows (all KV heads side by
 * side) are read once from memory, head after head: tasks per (sequence, KV head) would each
 * use a third of every cache line the prefetcher brings in. Writes each head's unnormalized
 * sum of values, running max and total weight to `partial` (num_heads x (head_dim + 2)).
 * head_dim is a constant in the specialized copies, so the inner loops have known bounds. */
#define DEFINE_ATTEND(NAME, T, LOAD)                                                               \
static inline __attribute__((always_inline)) void NAME(                                           \
        const T *query, const T *key_cache, const T *value_cache, const int64_t *table,           \
        int64_t first, int64_t last, float *partial, int64_t num_heads, int64_t group,            \
        int64_t head_dim, int64_t num_kv_heads, int64_t block_size, float scale) {                \
    float q[MAX_HEADS][MAX_HEAD_DIM], acc[MAX_HEADS][MAX_HEAD_DIM], row[MAX_HEAD_DIM];            \
    float scores[MAX_HEADS][TILE], running_max[MAX_HEADS], total[MAX_HEADS];                      \
    const T *key_rows[TILE], *value_rows[TILE];                                                   \
    const int64_t row_stride = num_kv_heads * head_dim; /* one cache row: all KV heads */         \
    for (int64_t h = 0; h < num_heads; ++h) {                                                     \
        for (int64_t d = 0; d < head_dim; ++d) {                                                  \
            q[h][d] = LOAD(query[h * head_dim + d]) * scale;                                      \
            acc[h][d] = 0.0f;                                                                     \
        }                                                                                         \
        running_max[h] = -INFINITY;                                                               \
        total[h] = 0.0f;                                                                          \
    }                                                                                             \
    for (int64_t t0 = first; t0 < last; t0 += TILE) {                                             \
        const int64_t n = last - t0 < TILE ? last - t0 : TILE;                                    \
        int64_t slots[TILE];                                                                      \
        tile_slots(table, t0, n, block_size, slots);                                              \
        for (int64_t i = 0; i < n; ++i) {                                                         \
            key_rows[i] = key_cache + slots[i] * row_stride;                                      \
            value_rows[i] = value_cache + slots[i] * row_stride;                                  \
        }                                                                                         \
        prefetch_tile(table, t0 + TILE, last, block_size, (const char *)key_cache,                \
                      (const char *)value_cache, row_stride * (int64_t)sizeof(T));                \
        for (int64_t g = 0; g < num_kv_heads; ++g) {                                              \
            for (int64_t i = 0; i < n; ++i) { /* a key converted once, scored for its heads */    \
                const T *k = key_rows[i] + g * head_dim;                                          \
                _Pragma("omp simd")                                                               \
                for (int64_t d = 0; d < head_dim; ++d) row[d] = LOAD(k[d]);                       \
                for (int64_t h = g * group; h < (g + 1) * group; ++h) {                           \
                    float dot = 0.0f;                                                             \
                    _Pragma("omp simd reduction(+:dot)")                                          \
                    for (int64_t d = 0; d < head_dim; ++d) dot += q[h][d] * row[d];               \
                    scores[h][i] = dot;                                                           \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        softmax_tile(scores, n, num_heads, running_max, total, acc, head_dim);                     \
        for (int64_t g = 0; g < num_kv_heads; ++g) {                                              \
            for (int64_t i = 0; i < n; ++i) { /* a value converted once, summed for its heads */  \
                const T *v = value_rows[i] + g * head_dim;                                        \
                _Pragma("omp simd")                                                               \
                for (int64_t d = 0; d < head_dim; ++d) row[d] = LOAD(v[d]);                       \
                for (int64_t h = g * group; h < (g + 1) * group; ++h) {                           \
                    const float p = scores[h][i];                                                 \
                    _Pragma("omp simd")                                                           \
                    for (int64_t d = 0; d < head_dim; ++d) acc[h][d] += p * row[d];               \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    store_partial(partial, acc, running_max, total, num_heads, head_dim);                         \
}

DEFINE_ATTEND(attend_bf16, uint16_t, bf16_to_float)
DEFINE_ATTEND(attend_f32, float, f32_to_float)

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

static inline __m512 load_bf16x16(const uint16_t *p) {  /* 16 bf16 -> float32, exactly */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16));
}

/* attend_bf16 for G query heads per KV head and head_dim HD, on AVX512-BF16: a query-key
 * score is two or four bf16 dot-product instructions (exact products, float32 sums) and 16
 * scores are reduced together; the G heads' value sums stay in registers while a tile's values
 * are added, each value row converted once for all G heads. */
#define DEFINE_ATTEND_FAST(G, HD)                                                                  \
static void attend_bf16_g##G##_d##HD(                                                              \
        const uint16_t *query, const uint16_t *key_cache, const uint16_t *value_cache,            \
        const int64_t *table, int64_t first, int64_t last, float *partial, int64_t num_heads,     \
        int64_t num_kv_heads, int64_t block_size, float scale) {                                  \
    enum { QC = HD / 32, AC = HD / 16 };                                                          \
    float acc[MAX_HEADS][MAX_HEAD_DIM], scores[MAX_HEADS][TILE], running_max[MAX_HEADS];          \
    float total[MAX_HEADS];                                                                       \
    __m512bh q[MAX_HEADS][QC];                                                                    \
    const uint16_t *key_rows[TILE], *value_rows[TILE];                                            \
    const int64_t row_stride = num_kv_heads * HD;                                                 \
    for (int64_t h = 0; h < num_heads; ++h) {                                                     \
        for (int c = 0; c < QC; ++c)                                                              \
            q[h][c] = (__m512bh)_mm512_loadu_si512((const void *)(query + h * HD + 32 * c));      \
        for (int64_t d = 0; d < HD; ++d) acc[h][d] = 0.0f;                                        \
        running_max[h] = -INFINITY;                                                               \
        total[h] = 0.0f;                                                                          \
    }                                                                                             \
    for (int64_t t0 = first; t0 < last; t0 += TILE) {                                             \
        const int64_t n = last - t0 < TILE ? last - t0 : TILE;                                    \
        int64_t slots[TILE];                                                                      \
        tile_slots(table, t0, n, block_size, slots);                                              \
        for (int64_t i = 0; i < n; ++i) {                                                         \
            key_rows[i] = key_cache + slots[i] * row_stride;                                      \
            value_rows[i] = value_cache + slots[i] * row_stride;                                  \
        }                                                                                         \
        prefetch_tile(table, t0 + TILE, last, block_size, (const char *)key_cache,                \
                      (const char *)value_cache, row_stride * 2);                                 \
        for (int64_t h = 0; h < num_heads; ++h) {                                                 \
            const int64_t g = h / G;                                                              \
            for (int64_t i0 = 0; i0 < n; i0 += 16) {                                              \
                __m512 part[16];                                                                  \
                for (int j = 0; j < 16; ++j) {                                                    \
                    part[j] = _mm512_setzero_ps();                                                \
                    if (i0 + j >= n) continue;                                                    \
                    const uint16_t *k = key_rows[i0 + j] + g * HD;                                \
                    for (int c = 0; c < QC; ++c)                                                  \
                        part[j] = _mm512_dpbf16_ps(part[j], q[h][c],                              \
                                                   (__m512bh)_mm512_loadu_si512((const void *)(k + 32 * c))); \
                }                                                                                 \
                _mm512_storeu_ps(&scores[h][i0], _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale))); \
            }                                                                                     \
        }                                                                                         \
        softmax_tile(scores, n, num_heads, running_max, total, acc, HD);                          \
        for (int64_t g = 0; g < num_kv_heads; ++g) {                                              \
            __m512 sums[G][AC];                                                                   \
            for (int hh = 0; hh < G; ++hh)                                                        \
                for (int c = 0; c < AC; ++c) sums[hh][c] = _mm512_loadu_ps(&acc[g * G + hh][16 * c]); \
            for (int64_t i = 0; i < n; ++i) {                                                     \
                __m512 v[AC];                                                                     \
                for (int c = 0; c < AC; ++c) v[c] = load_bf16x16(value_rows[i] + g * HD + 16 * c); \
                for (int hh = 0; hh < G; ++hh) {                                                  \
                    const __m512 p = _mm512_set1_ps(scores[g * G + hh][i]);                       \
                    for (int c = 0; c < AC; ++c) sums[hh][c] = _mm512_fmadd_ps(p, v[c], sums[hh][c]); \
                }                                                                                 \
            }                                                                                     \
            for (int hh = 0; hh < G; ++hh)                                                        \
                for (int c = 0; c < AC; ++c) _mm512_storeu_ps(&acc[g * G + hh][16 * c], sums[hh][c]); \
        }                                                                                         \
    }                                                                                             \
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

#if defined(VLLM_HAVE_AMX) && defined(VLLM_HAVE_LAZY_SOFTMAX)
#define AMX_MAX_HEADS 16   /* the lanes of a score tile */
#define AMX_MAX_GROUP 4    /* query heads per KV head: 4 x 4 value sums in registers */
#define AMX_KEYS 32        /* keys per softmax step: two score tiles */
#define PREFETCH_KEYS 64  /* how far ahead the cache rows are asked for */

static int amx_ready; /* set by paged_decode_enable_amx() */

/* Asks for the tile state; the bf16 kernel takes the AMX copy from then on (where it fits). */
int paged_decode_enable_amx(void) { return amx_ready = amx_request_tiles(); }

/* attend_bf16 on AMX for head_dim 64, all heads at once. The scores of 16 keys for every
 * head are one tile, S^T = K . Q^T, whose K-side operand is the cache rows themselves (all KV
 * heads side by side, 32 dims per product) and whose Q side is block-diagonal (head h has
 * zeros outside its KV head's dims):
 *
 *   S^T (16 keys x heads) = sum over 32-dim chunks c: K[:, c] (16 keys x 32) . Q^T[c] (pairs x heads)
 *
 * The softmax runs down the keys with the heads in the lanes (lazy_softmax.h), and the values
 * are summed with bf16 dot products over pairs of keys: a pair's two value rows interleaved
 * (two unpacks) times the pair's two weights, so the sums of a group's heads stay in registers
 * and no value is converted to float32. The unpacks interleave within 128-bit lanes, so the
 * sums hold the dims in that order (`unpacked_dim`) until they are written out. */
static inline int64_t unpacked_dim(int64_t v, int64_t lane) {
    /* vector v of a head's four: 0, 1 = unpacklo, unpackhi of dims 0-31; 2, 3 of dims 32-63 */
    return 32 * (v / 2) + 8 * (lane / 4) + 4 * (v % 2) + lane % 4;
}

static void configure_score_tiles(void) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) { /* 0, 1: scores; 2, 3, 5, 6: keys; 4, 7: queries */
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* Scores of keys [k0, k0 + 32) below `last` for every head, into tiles 0 (keys k0 ..) and 1
 * (k0 + 16 ..). The two tiles' chains of products alternate, and so do the operand tiles of
 * even and odd chunks, so that each product waits on fewer others. */
static inline void score_step_amx(const uint16_t *key_cache, const int64_t *table, int64_t k0, int64_t last,
                                  int64_t block_size, int64_t row, uint32_t qt[][16][16], int64_t chunks) {
    const uint16_t *k_lo = key_cache + slot_of(table, k0, block_size) * row;
    const uint16_t *k_hi = k0 + 16 < last ? key_cache + slot_of(table, k0 + 16, block_size) * row : NULL;
    const int64_t row_bytes = 2 * row;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < chunks; c += 2) {
        _tile_loadd(4, qt[c], 64);
        _tile_loadd(2, k_lo + 32 * c, row_bytes);
        _tile_dpbf16ps(0, 2, 4);
        if (k_hi) {
            _tile_loadd(3, k_hi + 32 * c, row_bytes);
            _tile_dpbf16ps(1, 3, 4);
        }
        _tile_loadd(7, qt[c + 1], 64);
        _tile_loadd(5, k_lo + 32 * (c + 1), row_bytes);
        _tile_dpbf16ps(0, 5, 7);
        if (k_hi) {
            _tile_loadd(6, k_hi + 32 * (c + 1), row_bytes);
            _tile_dpbf16ps(1, 6, 7);
        }
    }
}

static inline void store_scores_amx(int64_t k0, int64_t last, float s[AMX_KEYS][16]) {
    _tile_stored(0, s[0], 64);
    if (k0 + 16 < last) _tile_stored(1, s[16], 64);
}

static void attend_bf16_amx(const uint16_t *query, const uint16_t *key_cache, const uint16_t *value_cache,
                            const int64_t *table, int64_t first, int64_t last, float *partial,
                            int64_t num_heads, int64_t num_kv_heads, int64_t block_size, float scale) {
    const int64_t group = num_heads / num_kv_heads, chunks = 2 * num_kv_heads, row = num_kv_heads * 64;
    uint32_t qt[2 * AMX_MAX_HEADS][16][16] __attribute__((aligned(64)));  /* [chunk][dim pair][head] */
    memset(qt, 0, (size_t)chunks * sizeof qt[0]);
    for (int64_t h = 0; h < num_heads; ++h) {
        const uint32_t *q = (const uint32_t *)(query + h * 64);
        for (int64_t p = 0; p < 32; ++p) qt[2 * (h / group) + p / 16][p % 16][h] = q[p];
    }
    amx_publish_stores();
    float acc[AMX_MAX_HEADS][64] __attribute__((aligned(64)));  /* value sums, dims in unpacked order */
    memset(acc, 0, sizeof acc);
    float s[2][AMX_KEYS][16] __attribute__((aligned(64)));  /* this step's scores, the next's */
    uint32_t pairs[AMX_KEYS / 2][16] __attribute__((aligned(64)));
    struct lazy_softmax st = lazy_softmax_start(scale);
    const __mmask16 heads = (__mmask16)((1u << num_heads) - 1);
    configure_score_tiles();
    const int64_t begin = first / 16 * 16;
    score_step_amx(key_cache, table, begin, last, block_size, row, qt, chunks);
    store_scores_amx(begin, last, s[0]);
    for (int64_t k0 = begin, cur = 0; k0 < last; k0 += AMX_KEYS, cur ^= 1) {
        /* The next step's score tiles run on the AMX unit while this step's softmax and value
         * sums run on the vector units; they are stored after. */
        const int64_t next = k0 + AMX_KEYS;
        if (next < last) score_step_amx(key_cache, table, next, last, block_size, row, qt, chunks);
        for (int64_t k = k0 + PREFETCH_KEYS; k < k0 + PREFETCH_KEYS + AMX_KEYS && k < last; k += 16) {
            const char *kp = (const char *)(key_cache + slot_of(table, k, block_size) * row);
            const char *vp = (const char *)(value_cache + slot_of(table, k, block_size) * row);
            const int64_t end = (last - k < 16 ? last - k : 16) * row * 2;
            for (int64_t b = 0; b < end; b += 64) {
                _mm_prefetch(kp + b, _MM_HINT_T1);
                _mm_prefetch(vp + b, _MM_HINT_T1);
            }
        }
        __mmask16 keep[AMX_KEYS];
        for (int64_t j = 0; j < AMX_KEYS; ++j) keep[j] = k0 + j >= first && k0 + j < last ? heads : 0;
        __m512 alpha;
        if (lazy_softmax_raise(&st, masked_max((const float (*)[16])s[cur], keep, AMX_KEYS), &alpha)) {
            float factor[16] __attribute__((aligned(64)));
            _mm512_store_ps(factor, alpha);
            for (int64_t h = 0; h < num_heads; ++h)
                for (int v = 0; v < 4; ++v)
                    _mm512_store_ps(&acc[h][16 * v], _mm512_mul_ps(_mm512_load_ps(&acc[h][16 * v]),
                                                                   _mm512_set1_ps(factor[h])));
        }
        lazy_softmax_weights(&st, (const float (*)[16])s[cur], keep, AMX_KEYS, pairs);
        for (int64_t g = 0; g < num_kv_heads; ++g) {
            __m512 sums[AMX_MAX_GROUP][4];
            for (int64_t hh = 0; hh < group; ++hh)
                for (int v = 0; v < 4; ++v) sums[hh][v] = _mm512_load_ps(&acc[g * group + hh][16 * v]);
            for (int64_t j = 0; j < AMX_KEYS / 2; ++j) {
                if (!keep[2 * j] && !keep[2 * j + 1]) continue;
                /* Rows of keys outside [first, last) may hold anything: they are read as zeros. */
                __m512i a[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}, b[2] = {a[0], a[1]};
                if (keep[2 * j]) {
                    const uint16_t *v = value_cache + slot_of(table, k0 + 2 * j, block_size) * row + g * 64;
                    a[0] = _mm512_loadu_si512(v);
                    a[1] = _mm512_loadu_si512(v + 32);
                }
                if (keep[2 * j + 1]) {
                    const uint16_t *v = value_cache + slot_of(table, k0 + 2 * j + 1, block_size) * row + g * 64;
                    b[0] = _mm512_loadu_si512(v);
                    b[1] = _mm512_loadu_si512(v + 32);
                }
                const __m512bh vp[4] = {(__m512bh)_mm512_unpacklo_epi16(a[0], b[0]),
                                        (__m512bh)_mm512_unpackhi_epi16(a[0], b[0]),
                                        (__m512bh)_mm512_unpacklo_epi16(a[1], b[1]),
                                        (__m512bh)_mm512_unpackhi_epi16(a[1], b[1])};
                for (int64_t hh = 0; hh < group; ++hh) {
                    const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pairs[j][g * group + hh]);
                    for (int v = 0; v < 4; ++v) sums[hh][v] = _mm512_dpbf16_ps(sums[hh][v], vp[v], w);
                }
            }
            for (int64_t hh = 0; hh < group; ++hh)
                for (int v = 0; v < 4; ++v) _mm512_store_ps(&acc[g * group + hh][16 * v], sums[hh][v]);
        }
        if (next < last) store_scores_amx(next, last, s[cur ^ 1]);
    }
    _tile_release();
    float max[16] __attribute__((aligned(64))), total[16] __attribute__((aligned(64)));
    _mm512_store_ps(max, st.max);
    _mm512_store_ps(total, st.total);
    for (int64_t h = 0; h < num_heads; ++h) {
        float *ph = partial + h * (64 + 2);
        for (int64_t v = 0; v < 4; ++v)
            for (int64_t lane = 0; lane < 16; ++lane) ph[unpacked_dim(v, lane)] = acc[h][16 * v + lane];
        ph[64] = max[h] * scale; /* the merge weighs ranges by e^(max - top) on scaled scores */
        ph[65] = total[h];
    }
}
#define HAVE_ATTEND_AMX 1
#else
int paged_decode_enable_amx(void) { return 0; }
#endif

/* attend_bf16 on the fast copy for this group and head size where there is one. */
static inline void attend_bf16_any(const uint16_t *query, const uint16_t *key_cache,
                                   const uint16_t *value_cache, const int64_t *table, int64_t first,
                                   int64_t last, float *partial, int64_t num_heads, int64_t group,
                                   int64_t head_dim, int64_t num_kv_heads, int64_t block_size,
                                   float scale) {
#ifdef HAVE_ATTEND_AMX
    if (amx_ready && head_dim == 64 && num_heads <= AMX_MAX_HEADS && group <= AMX_MAX_GROUP &&
        block_size % 16 == 0) {
        attend_bf16_amx(query, key_cache, value_cache, table, first, last, partial, num_heads,
                        num_kv_heads, block_size, scale);
        return;
    }
#endif
#ifdef HAVE_ATTEND_FAST
#define FAST(G, HD)                                                                                \
    if (group == G && head_dim == HD) {                                                           \
        attend_bf16_g##G##_d##HD(query, key_cache, value_cache, table, first, last, partial,      \
                                 num_heads, num_kv_heads, block_size, scale);                     \
        return;                                                                                   \
    }
    FAST(1, 64) FAST(2, 64) FAST(3, 64) FAST(4, 64) FAST(1, 128) FAST(2, 128)
#undef FAST
#endif
    attend_bf16(query, key_cache, value_cache, table, first, last, partial, num_heads, group,
                head_dim, num_kv_heads, block_size, scale);
}

/* Fewer sequences than threads (batch-1 decode of a long context): each sequence's keys are
 * split into ranges attended in parallel, then merged by their maxima and total weights. */
#define DEFINE_PAGED_DECODE(NAME, ATTEND, T, STORE)                                                \
int NAME(const T *query, const T *key_cache, const T *value_cache, const int64_t *block_tables,   \
         const int64_t *seq_lens, T *out, int64_t num_seqs, int64_t num_heads,                    \
         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,          \
         int64_t window, float scale) {                                                           \
    if (num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads) return 1;   \
    const int64_t group = num_heads / num_kv_heads, stride = head_dim + 2;                        \
    int64_t longest = 0, splits = 1;                                                              \
    for (int64_t s = 0; s < num_seqs; ++s) longest = seq_lens[s] > longest ? seq_lens[s] : longest; \
    const int64_t threads = omp_get_max_threads();                                                \
    if (num_seqs < threads) { /* at least two tiles per range */                                 \
        splits = (threads + num_seqs - 1) / num_seqs;                                             \
        const int64_t most = longest / (2 * TILE);                                                \
        splits = splits < most ? splits : (most > 1 ? most : 1);                                  \
    }                                                                                             \
    float *partials = malloc(sizeof(float) * num_seqs * splits * num_heads * stride);             \
    if (partials == NULL) return 2;                                                               \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1)")                                  \
    for (int64_t s = 0; s < num_seqs; ++s) {                                                      \
        for (int64_t part = 0; part < splits; ++part) {                                           \
            const int64_t len = seq_lens[s];                                                      \
            const int64_t first = (window > 0 && len > window) ? len - window : 0;                \
            const int64_t range = ((len - first + splits - 1) / splits + TILE - 1) / TILE * TILE; \
            const int64_t lo = first + part * range < len ? first + part * range : len;           \
            const int64_t hi = lo + range < len ? lo + range : len;                               \
            const T *q = query + s * num_heads * head_dim;                                        \
            const int64_t *table = block_tables + s * max_blocks;                                 \
            float *partial = partials + (s * splits + part) * num_heads * stride;                 \
            if (head_dim == 64) /* the common sizes, with the loop bounds known */                \
                ATTEND(q, key_cache, value_cache, table, lo, hi, partial, num_heads, group, 64,   \
                       num_kv_heads, block_size, scale);                                          \
            else if (head_dim == 128)                                                             \
                ATTEND(q, key_cache, value_cache, table, lo, hi, partial, num_heads, group, 128,  \
                       num_kv_heads, block_size, scale);                                          \
            else                                                                                  \
                ATTEND(q, key_cache, value_cache, table, lo, hi, partial, num_heads, group,       \
                       head_dim, num_kv_heads, block_size, scale);                                \
        }                                                                                         \
    }                                                                                             \
    for (int64_t s = 0; s < num_seqs; ++s) {                                                      \
        for (int64_t h = 0; h < num_heads; ++h) {                                                 \
            const float *p0 = partials + (s * splits * num_heads + h) * stride;                   \
            float top = -INFINITY, total = 0.0f, acc[MAX_HEAD_DIM] = {0};                         \
            for (int64_t part = 0; part < splits; ++part) {                                       \
                const float m = p0[part * num_heads * stride + head_dim];                         \
                top = m > top ? m : top;                                                          \
            }                                                                                     \
            for (int64_t part = 0; part < splits; ++part) { /* empty ranges weigh ~1e-38 * 0 */  \
                const float *p = p0 + part * num_heads * stride;                                  \
                const float w = exp_nonpositive(p[head_dim] - top);                               \
                total += w * p[head_dim + 1];                                                     \
                for (int64_t d = 0; d < head_dim; ++d) acc[d] += w * p[d];                        \
            }                                                                                     \
            T *o = out + (s * num_heads + h) * head_dim;                                          \
            for (int64_t d = 0; d < head_dim; ++d) o[d] = STORE(acc[d] / total);                  \
        }                                                                                         \
    }                                                                                             \
    free(partials);                                                                               \
    return 0;                                                                                     \
}

/* The limits of the fixed-size buffers, for the caller to check before it relies on the kernel. */
int64_t paged_decode_max_heads(void) { return MAX_HEADS; }
int64_t paged_decode_max_head_dim(void) { return MAX_HEAD_DIM; }

DEFINE_PAGED_DECODE(paged_decode_bf16, attend_bf16_any, uint16_t, float_to_bf16)
DEFINE_PAGED_DECODE(paged_decode_f32, attend_f32, float, float_to_f32)
