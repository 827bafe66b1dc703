/*
 * Prefill attention that reads keys and values where they lie in the paged cache.
 *
 * A prefill chunk's queries (positions context_len .. context_len + query_len - 1 of their
 * sequence) attend causally to every earlier key: the context that earlier chunks left in the
 * cache and the chunk's own keys, which the step wrote to the cache before attention. One pass
 * covers both, so there is no gather of the blocks, no second softmax to merge and no mask
 * tensor. Keys are found through the block table (see cpu_paged_decode.c for the picture).
 *
 * One task = 16 queries of one head. Their scores are computed transposed, keys down and
 * queries across, so that the softmax over keys runs down the columns (one vector per key,
 * no horizontal reductions), 32 keys a step, with a lazy running softmax
 * (lazy_softmax.h). Scores, the weights' sums and the output are float32; the
 * weights enter the product with the values as bf16, as in torch's CPU flash attention. The
 * values are packed once per call as V^T, 32 keys a step (pack_values), the keys read in place.
 * Two copies of a task share this: on AMX tiles (cpu_paged_prefill_amx.h), and on AVX512-BF16
 * dot products (cpu_paged_prefill_avx512.h) for CPUs without AMX; the CPU's ISA, as the
 * compiler sees it, decides which exist, and AMX runs where both do (paged_prefill_use_amx).
 * Q^T and the output rows go through transposes in registers (transpose_16x16) rather than
 * through memory. Where AVX2 is the widest ISA built, cpu_paged_prefill_avx2.h has the same
 * task in float32 FMAs, 32 keys a step, on keys and values converted once per call.
 *
 * Layouts: query (num_tokens, num_heads, 64) with rows query_stride elements apart (q inside a
 * rotated q|k row), out (num_tokens, num_heads, 64) contiguous; caches (num_blocks, block_size,
 * num_kv_heads, 64) with block_size % 16 == 0, so that 16 keys from a multiple of 16 lie in
 * one block; block_tables (num_seqs, max_blocks), token_offsets, query_lens and context_lens
 * (num_seqs) int64. Only the rows of the sequences' queries are written. With window > 0 a query
 * attends to its last `window` keys only.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "lazy_softmax.h"
#include "paged_cache.h"

#define HEAD_DIM 64
#define QUERIES 16                 /* per task on AMX: the columns of a tile */
#define AVX512_TASK_QUERIES 32     /* per task on AVX512-BF16: two blocks of QUERIES */
#define KEYS 32                    /* per softmax step: two score tiles, one P^T tile */
#define VT_STEP (HEAD_DIM * KEYS)  /* elements of V^T per step and KV head: four 16 x 32 tiles */

int paged_prefill_head_dim(void) { return HEAD_DIM; }

/* One call's arguments, as paged_prefill_bf16 takes them. */
struct prefill {
    const uint16_t *query, *key_cache, *value_cache;
    const int64_t *block_tables, *token_offsets, *query_lens, *context_lens;
    uint16_t *out;
    int64_t query_stride, num_heads, num_kv_heads, block_size, max_blocks, window;
    float scale;
};

/* A kernel exists: AVX512-BF16 (and maybe AMX), or float32 on AVX2 FMAs. */
#if defined(VLLM_HAVE_LAZY_SOFTMAX) || (defined(__AVX2__) && defined(__FMA__))
#define HAVE_PAGED_PREFILL 1

struct task {
    int64_t seq, head, first_query;
};

/* A call's tasks, and its sequences' steps of keys, one per `keys` keys from key 0. */
struct task_list {
    int64_t num_tasks, num_steps;
    int64_t *first_step;  /* (num_seqs + 1): each sequence's first step; the last, num_steps */
    int64_t *step_seq;    /* (num_steps): each step's sequence */
    struct task *tasks;   /* per sequence, its last queries first (they see the most keys) */
};

static void free_tasks(struct task_list *l) { free(l->first_step), free(l->step_seq), free(l->tasks); }

/* The tasks of `per_task` queries and every head for each sequence; 0 where memory runs out. */
static int list_tasks(const struct prefill *a, int64_t num_seqs, int64_t per_task, int64_t keys, struct task_list *l) {
    const int64_t *query_lens = a->query_lens, *context_lens = a->context_lens;
    *l = (struct task_list){0, 0, malloc((size_t)(num_seqs + 1) * sizeof(int64_t)), NULL, NULL};
    if (!l->first_step) return 0;
    l->first_step[0] = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        l->first_step[s + 1] = l->first_step[s] + (context_lens[s] + query_lens[s] + keys - 1) / keys;
        l->num_tasks += (query_lens[s] + per_task - 1) / per_task * a->num_heads;
    }
    l->num_steps = l->first_step[num_seqs];
    l->step_seq = malloc((size_t)(l->num_steps > 0 ? l->num_steps : 1) * sizeof(int64_t));
    l->tasks = malloc((size_t)(l->num_tasks > 0 ? l->num_tasks : 1) * sizeof(struct task));
    if (!l->step_seq || !l->tasks) {
        free_tasks(l);
        return 0;
    }
    for (int64_t s = 0; s < num_seqs; ++s)
        for (int64_t i = l->first_step[s]; i < l->first_step[s + 1]; ++i) l->step_seq[i] = s;
    int64_t n = 0;
    for (int64_t s = 0; s < num_seqs; ++s)
        for (int64_t q0 = (query_lens[s] - 1) / per_task * per_task; q0 >= 0; q0 -= per_task)
            for (int64_t h = 0; h < a->num_heads; ++h) l->tasks[n++] = (struct task){s, h, q0};
    return 1;
}

/* The position of the last of the QUERIES queries from t's first: the last key any of them sees. */
static inline int64_t task_last_key(const struct prefill *a, const struct task *t) {
    const int64_t left = a->query_lens[t->seq] - t->first_query;
    return a->context_lens[t->seq] + t->first_query + (left < QUERIES ? left : QUERIES) - 1;
}

/* The first key of the first step (of `keys` keys) of queries from position `first` on: a
 * multiple of `keys` at or before the earliest key in the window of any of them. */
static inline int64_t first_key(int64_t first, int64_t window, int64_t keys) {
    return window > 0 && first - window + 1 > 0 ? (first - window + 1) / keys * keys : 0;
}

/* How a copy of the kernel runs a call: tasks of per_task queries; each sequence's steps of
 * `keys` keys prepared once per call, step_bytes each (prepare: step `step` of sequence `seq`,
 * which has num_keys keys), for its tasks to read (attend: from the sequence's first step);
 * tiles: AMX's, which each thread configures for its tasks. */
struct prefill_copy {
    int64_t per_task, keys, step_bytes;
    void (*prepare)(const struct prefill *a, int64_t seq, int64_t step, int64_t num_keys, void *out);
    void (*attend)(const struct prefill *a, const struct task *t, const void *steps);
    int tiles;
};
#endif

#if defined(VLLM_HAVE_LAZY_SOFTMAX)  /* AVX512-BF16 (and maybe AMX) */

int paged_prefill_supported(void) { return 1; }

/* Which of the queries at positions first .. first + 15 see keys k0 .. k0 + KEYS - 1 (lane q of
 * seen[j]: query first + q, key k0 + j): all, unless the step reaches the diagonal or the
 * window's edge; none for keys past `last`. */
static inline void visible_keys(__mmask16 seen[KEYS], int64_t k0, int64_t first, int64_t last, int64_t window) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const int64_t rows = last - k0 + 1 < KEYS ? last - k0 + 1 : KEYS;
    const int partial = k0 + KEYS - 1 > first || (window > 0 && k0 <= last - window);
    for (int64_t j = 0; j < KEYS; ++j) {
        seen[j] = j < rows ? 0xffff : 0;
        if (partial && j < rows) {  /* query q sees key k iff k <= first + q (> first + q - window) */
            const int64_t rel = k0 + j - first;
            seen[j] = _mm512_cmp_epi32_mask(lane, _mm512_set1_epi32((int)rel), _MM_CMPINT_NLT);
            if (window > 0)
                seen[j] &= _mm512_cmp_epi32_mask(lane, _mm512_set1_epi32((int)(rel + window)), _MM_CMPINT_LT);
        }
    }
}

/* V^T of keys [32 step, 32 step + 32) of one sequence, all KV heads: per head four tiles of
 * 16 dims x 32 keys; keys past num_keys are zero (their weights are zero, their cache rows
 * may hold anything). Each 32-bit gather takes a pair of dims of 16 keys (one block's
 * consecutive rows), and one permute of two such gathers makes each dim's row of 32 keys:
 * packing element by element would be a sizeable share of the kernel for short chunks. */
static void pack_values(const struct prefill *a, int64_t seq, int64_t step, int64_t num_keys,
                        uint16_t *vt) {
    const int64_t *table = a->block_tables + seq * a->max_blocks;
    const int64_t kvh_count = a->num_kv_heads, row = kvh_count * HEAD_DIM;  /* elements per key */
    /* words 2 i (the even dims), 2 i + 1 (the odd) of two vectors, the first's in words 0-15 */
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                          30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32((int)(row / 2)));  /* 32-bit words apart */
    const int32_t *first[2] = {NULL, NULL};  /* each half's first row: keys 32 step, 32 step + 16 */
    __mmask16 present[2] = {0, 0};
    for (int half = 0; half < 2; ++half) {
        const int64_t k0 = KEYS * step + 16 * half, count = num_keys - k0;
        if (count <= 0) continue;
        present[half] = count >= 16 ? 0xffff : (__mmask16)((1u << count) - 1);
        first[half] = (const int32_t *)(a->value_cache + slot_of(table, k0, a->block_size) * row);
    }
    for (int64_t h = 0; h < kvh_count; ++h)
        for (int64_t pair = 0; pair < HEAD_DIM / 2; ++pair) {  /* dims 2 pair, 2 pair + 1 */
            __m512i keys[2];
            for (int half = 0; half < 2; ++half)
                keys[half] = present[half] ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), present[half], rows,
                                                                          first[half] + h * HEAD_DIM / 2 + pair, 4)
                                           : _mm512_setzero_si512();
            uint16_t *dims = vt + h * VT_STEP + 2 * pair * KEYS;
            _mm512_store_si512(dims, _mm512_permutex2var_epi16(keys[0], even, keys[1]));
            _mm512_store_si512(dims + KEYS, _mm512_permutex2var_epi16(keys[0], odd, keys[1]));
        }
}

/* Transposes 16 rows of 16 32-bit lanes in place: r[i] lane j <- r[j] lane i. Pairs of rows
 * interleave, then fours, then 128-bit quarters trade places. */
static inline void transpose_16x16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    /* r[4 g + j], quarter L: lane 4 L + j of rows 4 g .. 4 g + 3 */
    for (int g = 0; g < 16; g += 4) {
        r[g] = _mm512_shuffle_ps(t[g], t[g + 2], 0x44);
        r[g + 1] = _mm512_shuffle_ps(t[g], t[g + 2], 0xee);
        r[g + 2] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0x44);
        r[g + 3] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0xee);
    }
    for (int j = 0; j < 4; ++j) {
        const __m512 even0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);    /* quarters 0, 2 of both */
        const __m512 even1 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        const __m512 odd0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);     /* quarters 1, 3 */
        const __m512 odd1 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
        t[j] = _mm512_shuffle_f32x4(even0, even1, 0x88);       /* lane j of every row */
        t[8 + j] = _mm512_shuffle_f32x4(even0, even1, 0xdd);   /* lane 8 + j */
        t[4 + j] = _mm512_shuffle_f32x4(odd0, odd1, 0x88);     /* lane 4 + j */
        t[12 + j] = _mm512_shuffle_f32x4(odd0, odd1, 0xdd);    /* lane 12 + j */
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
}

/* Q^T of a task's queries in pairs of dims: qt[p][q] = dims 2 p, 2 p + 1 of query q (queries
 * past the chunk: 0), the transpose of the queries' rows read as 32-bit pairs. */
static inline void pack_queries(const struct prefill *a, const struct task *t, uint32_t qt[HEAD_DIM / 2][QUERIES]) {
    const int64_t left = a->query_lens[t->seq] - t->first_query, nq = left < QUERIES ? left : QUERIES;
    const uint16_t *queries = a->query + (a->token_offsets[t->seq] + t->first_query) * a->query_stride +
                              t->head * HEAD_DIM;
    for (int c = 0; c < HEAD_DIM / 32; ++c) {
        __m512 r[16];
        for (int64_t q = 0; q < QUERIES; ++q)
            r[q] = q < nq ? _mm512_loadu_ps(queries + q * a->query_stride + 32 * c) : _mm512_setzero_ps();
        transpose_16x16(r);
        for (int p = 0; p < 16; ++p) _mm512_store_ps(qt[16 * c + p], r[p]);
    }
}

/* out[query q] = column q of O^T / total[q], as bf16, for the task's queries. */
static inline void store_output(const struct prefill *a, const struct task *t, const float o[HEAD_DIM][QUERIES],
                                __m512 total) {
    const int64_t left = a->query_lens[t->seq] - t->first_query, nq = left < QUERIES ? left : QUERIES;
    float inverse[QUERIES] __attribute__((aligned(64)));
    _mm512_store_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.0f), total));
    uint16_t *rows = a->out + ((a->token_offsets[t->seq] + t->first_query) * a->num_heads + t->head) * HEAD_DIM;
    for (int d0 = 0; d0 < HEAD_DIM; d0 += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(o[d0 + i]);
        transpose_16x16(r);  /* r[q]: dims d0 .. d0 + 15 of query q */
        for (int64_t q = 0; q < nq; ++q)
            store_bf16x16(rows + q * a->num_heads * HEAD_DIM + d0, _mm512_mul_ps(r[q], _mm512_set1_ps(inverse[q])));
    }
}

#include "cpu_paged_prefill_amx.h"
#include "cpu_paged_prefill_avx512.h"

static void pack_step(const struct prefill *a, int64_t seq, int64_t step, int64_t num_keys, void *out) {
    pack_values(a, seq, step, num_keys, out);
}

static void attend_avx512(const struct prefill *a, const struct task *t, const void *vt) {
    attend_task_avx512(a, t, vt);
}

#ifdef HAVE_PREFILL_AMX
static void attend_amx(const struct prefill *a, const struct task *t, const void *vt) { attend_task_amx(a, t, vt); }
#endif

/* V^T packed per step of KEYS keys; tasks on AMX tiles where they are ready, else AVX512-BF16's. */
static struct prefill_copy choose_copy(const struct prefill *a) {
    const int64_t step_bytes = a->num_kv_heads * VT_STEP * (int64_t)sizeof(uint16_t);
#ifdef HAVE_PREFILL_AMX
    if (amx_ready) return (struct prefill_copy){QUERIES, KEYS, step_bytes, pack_step, attend_amx, 1};
#endif
    return (struct prefill_copy){AVX512_TASK_QUERIES, KEYS, step_bytes, pack_step, attend_avx512, 0};
}

#elif defined(HAVE_PAGED_PREFILL)  /* float32 on AVX2 FMAs */

int paged_prefill_supported(void) { return 1; }
int paged_prefill_use_amx(int enable) { (void)enable; return 0; }

#include "cpu_paged_prefill_avx2.h"

#else  /* neither AVX512-BF16 nor AVX2 here: prefills keep torch's flash attention */

int paged_prefill_supported(void) { return 0; }
int paged_prefill_use_amx(int enable) { (void)enable; return 0; }

#endif

#ifdef HAVE_PAGED_PREFILL
/* Every chunk of the call: its steps prepared, then its tasks, longest first. */
static int attend_prefills(const struct prefill *a, int64_t num_seqs) {
    const struct prefill_copy c = choose_copy(a);
    struct task_list list;
    if (!list_tasks(a, num_seqs, c.per_task, c.keys, &list)) return 2;
    uint8_t *steps = aligned_alloc(64, (size_t)((list.num_steps > 0 ? list.num_steps : 1) * c.step_bytes));
    if (!steps) {
        free_tasks(&list);
        return 2;
    }
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < list.num_steps; ++i) {
            const int64_t s = list.step_seq[i];
            c.prepare(a, s, i - list.first_step[s], a->context_lens[s] + a->query_lens[s], steps + i * c.step_bytes);
        }
#ifdef HAVE_PREFILL_AMX
        if (c.tiles) amx_configure_full_tiles();
#endif
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < list.num_tasks; ++i)
            c.attend(a, &list.tasks[i], steps + list.first_step[list.tasks[i].seq] * c.step_bytes);
#ifdef HAVE_PREFILL_AMX
        if (c.tiles) _tile_release();
#endif
    }
    free(steps), free_tasks(&list);
    return 0;
}
#endif

int paged_prefill_bf16(const uint16_t *query, const uint16_t *key_cache, const uint16_t *value_cache,
                       const int64_t *block_tables, const int64_t *token_offsets,
                       const int64_t *query_lens, const int64_t *context_lens, uint16_t *out,
                       int64_t query_stride, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t block_size, int64_t max_blocks, int64_t window, float scale) {
    if (head_dim != HEAD_DIM || block_size % 16 || num_kv_heads < 1 || num_heads % num_kv_heads ||
        !(scale > 0.0f))  /* the running maximum is kept before the scale */
        return 1;
    const struct prefill a = {query, key_cache, value_cache, block_tables, token_offsets, query_lens,
                              context_lens, out, query_stride, num_heads, num_kv_heads, block_size,
                              max_blocks, window, scale};
#ifdef HAVE_PAGED_PREFILL
    return attend_prefills(&a, num_seqs);
#else
    (void)a;
    (void)num_seqs;
    return 1;
#endif
}
