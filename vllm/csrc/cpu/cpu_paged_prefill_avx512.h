/* Part of cpu_paged_prefill.c: a task on AVX512-BF16 dot products (attend_task_avx512), for
 * CPUs without AMX.
 *
 * The same products as the AMX copy, keys down and queries across, with the queries in the
 * 16 lanes of a vector; each vdpbf16ps multiplies 16 queries' pairs of dims (or of keys) by one
 * pair broadcast from memory, so nothing is reduced across lanes:
 *
 *   S^T[k]  (16 queries) = sum over pairs p: Q^T[p] . broadcast(key k's dims 2p, 2p + 1, read in the cache)
 *   O^T[d]  (16 queries) += sum over pairs j: P^T[j] . broadcast(V^T[d]'s keys 2j, 2j + 1)
 *
 * A step's 16 score rows or 16 output rows are the accumulators (16 of the 32 vector
 * registers), and each Q^T or P^T row feeds sixteen products. The values' products take the
 * weights as bf16 pairs, as on AMX: one vdpbf16ps does the work of two float32 FMAs and, on
 * the CPUs this copy is for, issues about as fast as one. O^T stays in memory (4 KB, L1)
 * between steps; the lazy softmax rescales it only when the maximum rises.
 */
#ifndef VLLM_CPU_PAGED_PREFILL_AVX512_H
#define VLLM_CPU_PAGED_PREFILL_AVX512_H

/* S^T of 16 keys (rows of s) for the task's queries (lanes), from Q^T in pairs of dims and the
 * keys' cache rows, `stride` elements apart from `keys`. */
static inline void score_keys(float s[16][QUERIES], const uint32_t qt[HEAD_DIM / 2][QUERIES], const uint16_t *keys,
                              int64_t stride) {
    __m512 acc[16];
    for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
    for (int p = 0; p < HEAD_DIM / 2; ++p) {
        const __m512bh q = (__m512bh)_mm512_load_si512(qt[p]);
        for (int k = 0; k < 16; ++k) acc[k] = _mm512_dpbf16_ps(acc[k], q, broadcast_bf16_pair(keys + k * stride + 2 * p));
    }
    for (int k = 0; k < 16; ++k) _mm512_store_ps(s[k], acc[k]);
}

/* O^T (dims x queries) += V^T . P^T for one step: vt, the step's V^T (dims x KEYS keys); pt,
 * its weights in pairs of keys x queries. */
static inline void add_values(float o[HEAD_DIM][QUERIES], const uint16_t *vt, const uint32_t pt[KEYS / 2][QUERIES]) {
    for (int d0 = 0; d0 < HEAD_DIM; d0 += 16) {
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_load_ps(o[d0 + i]);
        for (int j = 0; j < KEYS / 2; ++j) {
            const __m512bh p = (__m512bh)_mm512_load_si512(pt[j]);
            for (int i = 0; i < 16; ++i)
                acc[i] = _mm512_dpbf16_ps(acc[i], p, broadcast_bf16_pair(vt + (d0 + i) * KEYS + 2 * j));
        }
        for (int i = 0; i < 16; ++i) _mm512_store_ps(o[d0 + i], acc[i]);
    }
}

/* Queries first_query .. + 15 of head `head` of one sequence; vt: the sequence's packed V^T. */
static void attend_task_avx512(const struct prefill *a, const struct task *t, const uint16_t *vt) {
    const int64_t kvh_count = a->num_kv_heads, kvh = t->head / (a->num_heads / kvh_count);
    const int64_t first = a->context_lens[t->seq] + t->first_query, last = task_last_key(a, t);
    const int64_t *table = a->block_tables + t->seq * a->max_blocks, window = a->window;
    const int64_t stride = kvh_count * HEAD_DIM;  /* elements between two keys' cache rows */

    uint32_t qt[HEAD_DIM / 2][QUERIES] __attribute__((aligned(64)));
    pack_queries(a, t, qt);
    float o[HEAD_DIM][QUERIES] __attribute__((aligned(64)));
    for (int d = 0; d < HEAD_DIM; ++d) _mm512_store_ps(o[d], _mm512_setzero_ps());
    float s[KEYS][QUERIES] __attribute__((aligned(64)));
    uint32_t pt[KEYS / 2][QUERIES] __attribute__((aligned(64)));
    struct lazy_softmax st = lazy_softmax_start(a->scale);
    for (int64_t k0 = first_key(first, window); k0 <= last; k0 += KEYS) {
        for (int half = 0; half < 2; ++half) {  /* 16 keys from a multiple of 16: one block */
            const int64_t key = k0 + 16 * half;
            if (key <= last)
                score_keys(s + 16 * half, qt, a->key_cache + (slot_of(table, key, a->block_size) * kvh_count + kvh) * HEAD_DIM,
                           stride);
            else  /* no key: masked out, but defined */
                for (int k = 0; k < 16; ++k) _mm512_store_ps(s[16 * half + k], _mm512_setzero_ps());
        }
        __mmask16 seen[KEYS];
        visible_keys(seen, k0, first, last, window);
        const float (*scores)[QUERIES] = (const float (*)[QUERIES])s;
        if (!lazy_softmax_accept(&st, lazy_softmax_pairs(&st, scores, seen, KEYS, pt))) {
            __m512 alpha;
            if (lazy_softmax_raise(&st, masked_max(scores, seen, KEYS), &alpha))
                for (int d = 0; d < HEAD_DIM; ++d) _mm512_store_ps(o[d], _mm512_mul_ps(_mm512_load_ps(o[d]), alpha));
            st.total = _mm512_add_ps(st.total, lazy_softmax_pairs(&st, scores, seen, KEYS, pt));
        }
        add_values(o, vt + (k0 / KEYS * kvh_count + kvh) * VT_STEP, pt);
    }
    store_output(a, t, o, st.total);
}

#endif
