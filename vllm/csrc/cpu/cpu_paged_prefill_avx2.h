/* Part of cpu_paged_prefill.c: the kernel where AVX2 and FMA are the widest ISA built, in float32.
 *
 * The same task as the AVX512-BF16 copy (16 queries of one head, keys down and queries across,
 * so that nothing is reduced across lanes), with the queries in the lanes of two ymm vectors and
 * every product a float32 FMA. A call first converts its steps' keys and values to float32, once
 * for all the heads and queries that read them (each key row then takes a broadcast per dim
 * from L1, where bf16 would take a load, a shift and a broadcast):
 *
 *   S^T[k]  (16 queries) = sum over dims d: Q^T[d] * broadcast(K[k][d])
 *   O^T[d]  (16 queries) += sum over keys k: P^T[k] * broadcast(V[k][d])
 *
 * Steps are AVX2_KEYS keys from a multiple of AVX2_KEYS, so a query's steps, and the order of
 * every sum, do not depend on where its prefill was cut into chunks or which queries share its
 * task. The softmax is online, per lane: a lane's maximum rises to its step's when that is
 * larger, and only that lane's sums are rescaled (by exactly 1 elsewhere). The weights stay
 * float32 into the values' product; the output is rounded to bf16 once.
 */
#ifndef VLLM_CPU_PAGED_PREFILL_AVX2_H
#define VLLM_CPU_PAGED_PREFILL_AVX2_H

#include "exp.h"

#define AVX2_KEYS 32                         /* keys per softmax step, from a multiple of 32 */
#define AVX2_STEP (AVX2_KEYS * HEAD_DIM)     /* float32 elements of K (or V) per step and KV head */

/* Keys and values [step, step + 1) * AVX2_KEYS of one sequence, all KV heads, as a prepared step:
 * (2, KVH, AVX2_KEYS, 64) float32, the keys' rows then the values'; keys past num_keys are zero. */
static void convert_step(const struct prefill *a, int64_t seq, int64_t step, int64_t num_keys, void *out) {
    const int64_t *table = a->block_tables + seq * a->max_blocks;
    const int64_t kvh_count = a->num_kv_heads, row = kvh_count * HEAD_DIM;
    float *kf = out, *vf = kf + kvh_count * AVX2_STEP;
    for (int64_t j = 0; j < AVX2_KEYS; ++j) {
        const int64_t key = step * AVX2_KEYS + j;
        const uint16_t *k_row = NULL, *v_row = NULL;
        if (key < num_keys) {
            const int64_t slot = slot_of(table, key, a->block_size);
            k_row = a->key_cache + slot * row;
            v_row = a->value_cache + slot * row;
        }
        for (int64_t h = 0; h < kvh_count; ++h) {
            float *k_dst = kf + (h * AVX2_KEYS + j) * HEAD_DIM, *v_dst = vf + (h * AVX2_KEYS + j) * HEAD_DIM;
            for (int d = 0; d < HEAD_DIM; d += 8) {
                _mm256_store_ps(k_dst + d, k_row ? bf16x8_to_float(k_row + h * HEAD_DIM + d) : _mm256_setzero_ps());
                _mm256_store_ps(v_dst + d, v_row ? bf16x8_to_float(v_row + h * HEAD_DIM + d) : _mm256_setzero_ps());
            }
        }
    }
}

/* A task's queries: Q^T, O^T, a step's scores (then weights) S^T, and the softmax per lane. */
struct avx2_task {
    float qt[HEAD_DIM][QUERIES] __attribute__((aligned(32)));
    float o[HEAD_DIM][QUERIES] __attribute__((aligned(32)));
    float s[AVX2_KEYS][QUERIES] __attribute__((aligned(32)));
    __m256 max[2], total[2];  /* lanes 0-7, 8-15: raw scores' maximum (before the scale), weights' sum */
};

/* S^T rows k0 .. k0 + n - 1 (n <= 6: 2 n accumulators, each FMA's latency hidden behind the
 * others'; n a constant in each caller). */
static inline __attribute__((always_inline)) void score_keys(struct avx2_task *b, const float *kf, int k0, const int n) {
    __m256 acc[6][2];
    for (int j = 0; j < n; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int d = 0; d < HEAD_DIM; ++d) {
        const __m256 q0 = _mm256_load_ps(b->qt[d]), q1 = _mm256_load_ps(b->qt[d] + 8);
        for (int j = 0; j < n; ++j) {
            const __m256 key = _mm256_broadcast_ss(kf + (k0 + j) * HEAD_DIM + d);
            acc[j][0] = _mm256_fmadd_ps(q0, key, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(q1, key, acc[j][1]);
        }
    }
    for (int j = 0; j < n; ++j) {
        _mm256_store_ps(b->s[k0 + j], acc[j][0]);
        _mm256_store_ps(b->s[k0 + j] + 8, acc[j][1]);
    }
}

/* S^T = Q^T . K^T for a step's keys (kf: (AVX2_KEYS, 64) float32 rows), 6, 6, 6, 6, 4 and 4 keys at once. */
static inline void score_step(struct avx2_task *b, const float *kf) {
    score_keys(b, kf, 0, 6);
    score_keys(b, kf, 6, 6);
    score_keys(b, kf, 12, 6);
    score_keys(b, kf, 18, 6);
    score_keys(b, kf, 24, 4);
    score_keys(b, kf, 28, 4);
}

/* O^T rows d0 .. d0 + n - 1 += their share of V^T . P^T (n <= 6, a constant in each caller). */
static inline __attribute__((always_inline)) void add_dims(struct avx2_task *b, const float *vf, int d0, const int n) {
    __m256 acc[6][2];
    for (int i = 0; i < n; ++i) {
        acc[i][0] = _mm256_load_ps(b->o[d0 + i]);
        acc[i][1] = _mm256_load_ps(b->o[d0 + i] + 8);
    }
    for (int j = 0; j < AVX2_KEYS; ++j) {
        const __m256 p0 = _mm256_load_ps(b->s[j]), p1 = _mm256_load_ps(b->s[j] + 8);
        for (int i = 0; i < n; ++i) {
            const __m256 value = _mm256_broadcast_ss(vf + j * HEAD_DIM + d0 + i);
            acc[i][0] = _mm256_fmadd_ps(p0, value, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(p1, value, acc[i][1]);
        }
    }
    for (int i = 0; i < n; ++i) {
        _mm256_store_ps(b->o[d0 + i], acc[i][0]);
        _mm256_store_ps(b->o[d0 + i] + 8, acc[i][1]);
    }
}

/* O^T += V^T . P^T for a step (vf: (AVX2_KEYS, 64) float32 rows; P^T in b->s), 6 dims at once. */
static inline void add_step_values(struct avx2_task *b, const float *vf) {
    for (int d0 = 0; d0 < 60; d0 += 6) add_dims(b, vf, d0, 6);
    add_dims(b, vf, 60, 4);
}

/* The softmax of a step's scores of keys k0 .. k0 + AVX2_KEYS - 1, in place as weights, for the
 * queries at positions `position` (lanes 0-7, 8-15); a key counts for a query iff it is not past
 * it and (window > 0) is one of its last `window`. Raises each lane's maximum to the step's where
 * larger, rescaling that lane's sums. */
static inline void softmax_step(struct avx2_task *b, int64_t k0, const __m256i position[2], int64_t window,
                                float scale) {
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY), c = _mm256_set1_ps(scale);
    for (int half = 0; half < 2; ++half) {
        __m256i seen[AVX2_KEYS];
        __m256 step_max = minus_inf;
        for (int j = 0; j < AVX2_KEYS; ++j) {
            const __m256i key = _mm256_set1_epi32((int32_t)(k0 + j));
            seen[j] = _mm256_cmpgt_epi32(_mm256_add_epi32(position[half], _mm256_set1_epi32(1)), key);
            if (window > 0)
                seen[j] = _mm256_and_si256(seen[j], _mm256_cmpgt_epi32(
                    key, _mm256_sub_epi32(position[half], _mm256_set1_epi32((int32_t)window))));
            step_max = _mm256_max_ps(step_max, _mm256_blendv_ps(minus_inf, _mm256_load_ps(b->s[j] + 8 * half),
                                                               _mm256_castsi256_ps(seen[j])));
        }
        const __m256 old_max = b->max[half], new_max = _mm256_max_ps(old_max, step_max);
        if (_mm256_movemask_ps(_mm256_cmp_ps(new_max, old_max, _CMP_GT_OQ))) {
            /* 1 exactly where the maximum stays; where it was -inf the sums are still 0 */
            const __m256 alpha = exp_nonpositive_x8(_mm256_mul_ps(_mm256_sub_ps(old_max, new_max), c));
            b->total[half] = _mm256_mul_ps(b->total[half], alpha);
            for (int d = 0; d < HEAD_DIM; ++d)
                _mm256_store_ps(b->o[d] + 8 * half, _mm256_mul_ps(_mm256_load_ps(b->o[d] + 8 * half), alpha));
            b->max[half] = new_max;
        }
        __m256 total = b->total[half];
        for (int j = 0; j < AVX2_KEYS; ++j) {
            float *row = b->s[j] + 8 * half;
            const __m256 w = exp_nonpositive_x8(_mm256_mul_ps(_mm256_sub_ps(_mm256_load_ps(row), new_max), c));
            const __m256 kept = _mm256_and_ps(w, _mm256_castsi256_ps(seen[j]));  /* whatever w is where unseen */
            total = _mm256_add_ps(total, kept);
            _mm256_store_ps(row, kept);
        }
        b->total[half] = total;
    }
}

/* Queries first_query .. + 15 of head `head` of one sequence; steps: the sequence's steps as
 * convert_step leaves them. */
static void attend_task_avx2(const struct prefill *a, const struct task *t, const void *steps) {
    const int64_t kvh_count = a->num_kv_heads, kvh = t->head / (a->num_heads / kvh_count);
    const int64_t left = a->query_lens[t->seq] - t->first_query, nq = left < QUERIES ? left : QUERIES;
    const int64_t first = a->context_lens[t->seq] + t->first_query, last = task_last_key(a, t);
    const int64_t from = first_key(first, a->window, AVX2_KEYS);
    const uint16_t *queries = a->query + (a->token_offsets[t->seq] + t->first_query) * a->query_stride +
                              t->head * HEAD_DIM;
    struct avx2_task b;
    for (int64_t q = 0; q < QUERIES; ++q)
        for (int d = 0; d < HEAD_DIM; ++d) b.qt[d][q] = q < nq ? bf16_to_float(queries[q * a->query_stride + d]) : 0.0f;
    memset(b.o, 0, sizeof b.o);
    __m256i position[2];
    for (int half = 0; half < 2; ++half) {
        position[half] = _mm256_add_epi32(_mm256_set1_epi32((int32_t)(first + 8 * half)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        b.max[half] = _mm256_set1_ps(-INFINITY);
        b.total[half] = _mm256_setzero_ps();
    }
    for (int64_t k0 = from; k0 <= last; k0 += AVX2_KEYS) {
        const float *keys = (const float *)steps + (k0 / AVX2_KEYS * 2 * kvh_count + kvh) * AVX2_STEP;
        score_step(&b, keys);
        softmax_step(&b, k0, position, a->window, a->scale);
        add_step_values(&b, keys + kvh_count * AVX2_STEP);
    }
    float total[QUERIES] __attribute__((aligned(32)));
    _mm256_store_ps(total, b.total[0]);
    _mm256_store_ps(total + 8, b.total[1]);
    uint16_t *rows = a->out + ((a->token_offsets[t->seq] + t->first_query) * a->num_heads + t->head) * HEAD_DIM;
    for (int64_t q = 0; q < nq; ++q) {
        const __m256 inverse = _mm256_set1_ps(1.0f / total[q]);
        for (int d0 = 0; d0 < HEAD_DIM; d0 += 8) {
            float column[8] __attribute__((aligned(32)));
            for (int i = 0; i < 8; ++i) column[i] = b.o[d0 + i][q];
            store_bf16x8(rows + q * a->num_heads * HEAD_DIM + d0, _mm256_mul_ps(_mm256_load_ps(column), inverse));
        }
    }
}

/* Keys and values converted per step of AVX2_KEYS keys; tasks of QUERIES queries. */
static struct prefill_copy choose_copy(const struct prefill *a) {
    const int64_t step_bytes = 2 * a->num_kv_heads * AVX2_STEP * (int64_t)sizeof(float);
    return (struct prefill_copy){QUERIES, AVX2_KEYS, step_bytes, convert_step, attend_task_avx2, 0};
}

#endif  /* VLLM_CPU_PAGED_PREFILL_AVX2_H */
