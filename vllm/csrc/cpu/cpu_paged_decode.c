/*
 * Decode attention on CPU that reads keys and values where they lie in the paged cache.
 *
 * Every sequence has one query token. Its keys are the first seq_len slots of its blocks:
 *
 *   block_tables[s] = [ 7 | 2 | 9 ]          block_size 4, seq_len 10
 *   key t           -> block block_tables[s][t / 4], row t % 4
 *   keys 0..9       = rows 0-3 of block 7, rows 0-3 of block 2, rows 0-1 of block 9
 *
 * A task attends all heads of one sequence with an online softmax over tiles of keys, each
 * tile's rows read into the cache in one pass before it is computed: no gather of the blocks,
 * no padding to the longest sequence, no mask. A sequence of more than a tile of keys is split
 * over several tasks (task_parts) and the parts merged. Scores, softmax and the
 * weighted sum of values stay in float32. Decode attention is bound by reading the cache, and this reads each
 * key and value row once, where gathering the blocks for SDPA reads them, writes a padded copy
 * and reads that again. bf16 caches with 1-4 query heads per KV head (head_dim 64) or 1-2
 * (head_dim 128) take a copy on AVX512-BF16 dot products with the value sums in registers: the
 * scores from pairs of dims, the values from pairs of keys with their weights in bf16, as the
 * prefill kernels take them. Where AMX is there, bf16 with head_dim 64, at most 16 heads and 4
 * per KV head takes a third copy: the scores of all heads as tile products, the values by
 * float32 FMAs, the next rows prefetched (attend_bf16_amx), which leaves the vector units free
 * for the softmax and the value sums.
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
#include <xmmintrin.h>

#include "amx.h"
#include "bf16.h"
#include "exp.h"
#include "lane_sum.h"
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

/* Asks for rows [first, end) of a tile (row_bytes each, in both caches) into L2. */
static inline void prefetch_rows(const char *const *key_rows, const char *const *value_rows, int64_t first,
                                 int64_t end, int64_t row_bytes) {
    for (int64_t i = first; i < end; ++i)
        for (int64_t b = 0; b < row_bytes; b += 64) {
            _mm_prefetch(key_rows[i] + b, _MM_HINT_T1);
            _mm_prefetch(value_rows[i] + b, _MM_HINT_T1);
        }
}

/* Reads a byte of every cache line of rows [0, n) in both caches, row after row. */
static inline void touch_rows(const char *const *key_rows, const char *const *value_rows, int64_t n,
                              int64_t row_bytes) {
    uint8_t sink = 0;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t b = 0; b < row_bytes; b += 64)
            sink |= *(volatile const uint8_t *)(key_rows[i] + b) | *(volatile const uint8_t *)(value_rows[i] + b);
    (void)sink;
}

/* Reads a byte of every cache line of a tile's rows in both caches, before the tile is
 * computed. From memory, lines arrive at the rate of the misses in flight: the tile's own loads,
 * spread among its arithmetic, keep few in flight; these loads, with nothing between them, keep
 * many, and the arithmetic then finds the tile in the cache. Every line is first asked for into
 * L2, whose misses in flight outnumber the loads': the loads then wait on lines already coming.
 * The AVX512-BF16 copies also ask for the next tile's rows into L2 while they score a tile, so
 * that these loads find them there. */
static inline void load_tile(const char *const *key_rows, const char *const *value_rows, int64_t n,
                             int64_t row_bytes) {
    prefetch_rows(key_rows, value_rows, 0, n, row_bytes);
    touch_rows(key_rows, value_rows, n, row_bytes);
}

/* The cache rows of keys t0 .. t0 + n - 1 of a sequence, n = min(TILE, last - t0) (0 from
 * `last` on), in both caches (row_bytes apart: all KV heads side by side); returns n. */
static inline int64_t tile_row_pointers(const int64_t *table, int64_t t0, int64_t last, int64_t block_size,
                                        const char *key_cache, const char *value_cache, int64_t row_bytes,
                                        const char **key_rows, const char **value_rows) {
    const int64_t n = last <= t0 ? 0 : last - t0 < TILE ? last - t0 : TILE;
    int64_t slots[TILE];
    tile_slots(table, t0, n, block_size, slots);
    for (int64_t i = 0; i < n; ++i) {
        key_rows[i] = key_cache + slots[i] * row_bytes;
        value_rows[i] = value_cache + slots[i] * row_bytes;
    }
    return n;
}

/* tile_row_pointers, the rows then loaded into the cache (load_tile). */
static inline int64_t tile_rows(const int64_t *table, int64_t t0, int64_t last, int64_t block_size,
                                const char *key_cache, const char *value_cache, int64_t row_bytes,
                                const char **key_rows, const char **value_rows) {
    const int64_t n = tile_row_pointers(table, t0, last, block_size, key_cache, value_cache, row_bytes,
                                        key_rows, value_rows);
    load_tile(key_rows, value_rows, n, row_bytes);
    return n;
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
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
        /* GCC leaves the scalar loop below scalar: AVX2 builds take 8 scores at a time. */
        __m256 sums = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            const __m256 e = exp_nonpositive_x8(_mm256_sub_ps(_mm256_loadu_ps(scores[h] + i), _mm256_set1_ps(new_max)));
            _mm256_storeu_ps(scores[h] + i, e);
            sums = _mm256_add_ps(sums, e);
        }
        sum = sum_x8(sums);
#endif
        for (; i < n; ++i) {
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
    const char *key_rows[TILE], *value_rows[TILE];                                                \
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
        const int64_t n = tile_rows(table, t0, last, block_size, (const char *)key_cache,         \
                                    (const char *)value_cache, row_stride * (int64_t)sizeof(T),   \
                                    key_rows, value_rows);                                        \
        for (int64_t g = 0; g < num_kv_heads; ++g) {                                              \
            for (int64_t i = 0; i < n; ++i) { /* a key converted once, scored for its heads */    \
                const T *k = (const T *)key_rows[i] + g * head_dim;                               \
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
                const T *v = (const T *)value_rows[i] + g * head_dim;                             \
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

/* The faster copies of attend_bf16, in parts of this file: AVX512-BF16 dot products for the
 * common group sizes, AMX tiles for the scores of all heads at once, and, where neither is
 * built, AVX2 for head_dim 64 (attend_f32's too). */
#include "cpu_paged_decode_avx512.h"
#include "cpu_paged_decode_amx.h"
#include "cpu_paged_decode_avx2.h"

/* attend_bf16, or where f32 attend_f32, on the AVX2 copy where it is built and takes the head
 * size: 1 if it did. A call of its own, outside the task loop (inlined into it, the float32 copy
 * ran slower), with a copy specialized for each element type. */
static __attribute__((noinline)) int attended_on_avx2(
        const void *query, const void *key_cache, const void *value_cache, const int64_t *table, int64_t first,
        int64_t last, float *partial, int64_t num_heads, int64_t group, int64_t head_dim, int64_t num_kv_heads,
        int64_t block_size, float scale, int f32) {
#ifdef HAVE_ATTEND_AVX2
    if (head_dim != AVX2_HEAD_DIM) return 0;
    if (f32)
        attend_avx2_d64(query, key_cache, value_cache, table, first, last, partial, num_heads, group, num_kv_heads,
                        block_size, scale, 1);
    else
        attend_avx2_d64(query, key_cache, value_cache, table, first, last, partial, num_heads, group, num_kv_heads,
                        block_size, scale, 0);
    return 1;
#else
    (void)query, (void)key_cache, (void)value_cache, (void)table, (void)first, (void)last, (void)partial;
    (void)num_heads, (void)group, (void)head_dim, (void)num_kv_heads, (void)block_size, (void)scale, (void)f32;
#endif
    return 0;
}

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
    if (attended_on_avx2(query, key_cache, value_cache, table, first, last, partial, num_heads, group, head_dim,
                         num_kv_heads, block_size, scale, 0))
        return;
    attend_bf16(query, key_cache, value_cache, table, first, last, partial, num_heads, group,
                head_dim, num_kv_heads, block_size, scale);
}

/* attend_f32 on the AVX2 copy for head_dim 64 where it is built. */
static inline void attend_f32_any(const float *query, const float *key_cache, const float *value_cache,
                                  const int64_t *table, int64_t first, int64_t last, float *partial,
                                  int64_t num_heads, int64_t group, int64_t head_dim, int64_t num_kv_heads,
                                  int64_t block_size, float scale) {
    if (!attended_on_avx2(query, key_cache, value_cache, table, first, last, partial, num_heads, group, head_dim,
                          num_kv_heads, block_size, scale, 1))
        attend_f32(query, key_cache, value_cache, table, first, last, partial, num_heads, group, head_dim,
                   num_kv_heads, block_size, scale);
}

static inline int64_t attended_keys(int64_t seq_len, int64_t window) {
    return window > 0 && seq_len > window ? window : seq_len;
}

/* The tasks of a sequence of `keys` keys. Up to TASK_KEYS, one a tile, so that a sequence alone
 * (as in batch-1 decode) still spreads over several threads instead of keeping one busy while
 * the others wait. More, an even count of parts (ceil(keys / TASK_KEYS), rounded up) with the
 * tiles dealt evenly among them; but where that count is odd and the last of parts of TASK_KEYS
 * would be short (under half of one), those parts as they are, since two threads then end
 * within the short one. Parts of TASK_KEYS alone would leave one thread a part more than the
 * other: a sequence of 272 keys, 256 on one thread and 16 on the other. Counts fixed by the
 * sequence's own length, not shares of the step's keys or threads: its parts, and so the order
 * its partial sums merge in, depend on its length only, so its attention is the same bits
 * whatever else the step holds. */
#define TASK_KEYS (4 * TILE)

/* Whether a sequence of more than TASK_KEYS keys takes parts of TASK_KEYS and the rest. */
static inline int whole_parts(int64_t keys) {
    const int64_t parts = (keys + TASK_KEYS - 1) / TASK_KEYS;
    return parts % 2 == 1 && keys - (parts - 1) * TASK_KEYS < TASK_KEYS / 2;
}

static inline int64_t task_parts(int64_t keys) {
    const int64_t tiles = (keys + TILE - 1) / TILE, parts = (keys + TASK_KEYS - 1) / TASK_KEYS;
    if (keys <= TASK_KEYS) return tiles > 0 ? tiles : 1;
    return whole_parts(keys) ? parts : parts + parts % 2;
}

/* Where part p of a sequence's `parts` (task_parts) starts, in keys from its first attended one
 * (p = parts: `keys`). */
static inline int64_t part_start(int64_t keys, int64_t parts, int64_t p) {
    int64_t start;
    if (keys <= TASK_KEYS) start = p * TILE;
    else if (whole_parts(keys)) start = p * TASK_KEYS;
    else start = TILE * (p * ((keys + TILE - 1) / TILE) / parts);  /* the tiles dealt evenly */
    return start < keys ? start : keys;
}

/* Each sequence's keys in its tasks (task_parts), attended in parallel, then each
 * sequence's parts merged by their maxima and total weights. */
#define DEFINE_PAGED_DECODE(NAME, ATTEND, T, STORE)                                                \
int NAME(const T *query, const T *key_cache, const T *value_cache, const int64_t *block_tables,   \
         const int64_t *seq_lens, T *out, int64_t num_seqs, int64_t num_heads,                    \
         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,          \
         int64_t window, float scale) {                                                           \
    if (num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads) return 1;   \
    const int64_t group = num_heads / num_kv_heads, stride = head_dim + 2;                        \
    int64_t *first_task = malloc(sizeof(int64_t) * (num_seqs + 1)), num_tasks = 0;               \
    if (first_task == NULL) return 2;                                                             \
    for (int64_t s = 0; s < num_seqs; ++s) {                                                      \
        first_task[s] = num_tasks;                                                                \
        num_tasks += task_parts(attended_keys(seq_lens[s], window));                              \
    }                                                                                             \
    first_task[num_seqs] = num_tasks;                                                             \
    int64_t *task_seq = malloc(sizeof(int64_t) * (num_tasks > 0 ? num_tasks : 1));               \
    float *partials = malloc(sizeof(float) * (num_tasks > 0 ? num_tasks : 1) * num_heads * stride); \
    if (task_seq == NULL || partials == NULL) {                                                   \
        free(first_task), free(task_seq), free(partials);                                         \
        return 2;                                                                                 \
    }                                                                                             \
    for (int64_t s = 0; s < num_seqs; ++s)                                                        \
        for (int64_t i = first_task[s]; i < first_task[s + 1]; ++i) task_seq[i] = s;              \
    _Pragma("omp parallel")                                                                       \
    {                                                                                             \
    _Pragma("omp for schedule(dynamic, 1)")                                                       \
    for (int64_t i = 0; i < num_tasks; ++i) {                                                     \
        const int64_t s = task_seq[i], len = seq_lens[s], keys = attended_keys(len, window);       \
        const int64_t parts = first_task[s + 1] - first_task[s], part = i - first_task[s];        \
        const int64_t lo = len - keys + part_start(keys, parts, part);                            \
        const int64_t hi = len - keys + part_start(keys, parts, part + 1);                        \
        const T *q = query + s * num_heads * head_dim;                                            \
        const int64_t *table = block_tables + s * max_blocks;                                     \
        float *partial = partials + i * num_heads * stride;                                       \
        if (head_dim == 64) /* the common sizes, with the loop bounds known */                    \
            ATTEND(q, key_cache, value_cache, table, lo, hi, partial, num_heads, group, 64,       \
                   num_kv_heads, block_size, scale);                                              \
        else if (head_dim == 128)                                                                 \
            ATTEND(q, key_cache, value_cache, table, lo, hi, partial, num_heads, group, 128,      \
                   num_kv_heads, block_size, scale);                                              \
        else                                                                                      \
            ATTEND(q, key_cache, value_cache, table, lo, hi, partial, num_heads, group,           \
                   head_dim, num_kv_heads, block_size, scale);                                    \
    }                                                                                             \
    /* The merge, sequences shared out too (the loop's barrier has made every part visible). */   \
    _Pragma("omp for schedule(static)")                                                           \
    for (int64_t s = 0; s < num_seqs; ++s) {                                                      \
        for (int64_t h = 0; h < num_heads; ++h) {                                                 \
            float top = -INFINITY, total = 0.0f, acc[MAX_HEAD_DIM] = {0};                         \
            for (int64_t i = first_task[s]; i < first_task[s + 1]; ++i) {                         \
                const float m = partials[(i * num_heads + h) * stride + head_dim];                \
                top = m > top ? m : top;                                                          \
            }                                                                                     \
            for (int64_t i = first_task[s]; i < first_task[s + 1]; ++i) {                         \
                const float *p = partials + (i * num_heads + h) * stride;                         \
                const float w = exp_nonpositive(p[head_dim] - top); /* empty: ~1e-38 * 0 */       \
                total += w * p[head_dim + 1];                                                     \
                for (int64_t d = 0; d < head_dim; ++d) acc[d] += w * p[d];                        \
            }                                                                                     \
            T *o = out + (s * num_heads + h) * head_dim;                                          \
            for (int64_t d = 0; d < head_dim; ++d) o[d] = STORE(acc[d] / total);                  \
        }                                                                                         \
    }                                                                                             \
    }                                                                                             \
    free(first_task), free(task_seq), free(partials);                                             \
    return 0;                                                                                     \
}

/* The limits of the fixed-size buffers, for the caller to check before it relies on the kernel. */
int64_t paged_decode_max_heads(void) { return MAX_HEADS; }
int64_t paged_decode_max_head_dim(void) { return MAX_HEAD_DIM; }

DEFINE_PAGED_DECODE(paged_decode_bf16, attend_bf16_any, uint16_t, float_to_bf16)
DEFINE_PAGED_DECODE(paged_decode_f32, attend_f32_any, float, float_to_f32)
