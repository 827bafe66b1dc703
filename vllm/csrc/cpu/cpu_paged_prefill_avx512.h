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
 * registers), and each Q^T or P^T row feeds sixteen products. A task takes two blocks of 16
 * queries where the chunk has them, and the steps both see run 8 keys or dims of both at once:
 * each broadcast pair then feeds two products, which leaves the loads fewer than the products.
 * The values' products take the weights as bf16 pairs, as on AMX: one vdpbf16ps does the work of
 * two float32 FMAs and, on the CPUs this copy is for, issues about as fast as one. O^T stays in
 * memory (4 KB per block, L1) between steps; the lazy softmax rescales it only when the maximum
 * rises.
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

/* S^T of 16 keys for two blocks' queries at once: the keys in two groups of 8, each key's pair of
 * dims broadcast once for both blocks (10 loads for 16 products where score_keys takes 17), with
 * each product in the order score_keys adds it. */
static inline void score_keys_pair(float s0[16][QUERIES], float s1[16][QUERIES],
                                   const uint32_t qt0[HEAD_DIM / 2][QUERIES], const uint32_t qt1[HEAD_DIM / 2][QUERIES],
                                   const uint16_t *keys, int64_t stride) {
    for (int k0 = 0; k0 < 16; k0 += 8) {
        __m512 acc0[8], acc1[8];
        for (int k = 0; k < 8; ++k) acc0[k] = acc1[k] = _mm512_setzero_ps();
        for (int p = 0; p < HEAD_DIM / 2; ++p) {
            const __m512bh q0 = (__m512bh)_mm512_load_si512(qt0[p]), q1 = (__m512bh)_mm512_load_si512(qt1[p]);
            for (int k = 0; k < 8; ++k) {
                const __m512bh key = broadcast_bf16_pair(keys + (k0 + k) * stride + 2 * p);
                acc0[k] = _mm512_dpbf16_ps(acc0[k], q0, key);
                acc1[k] = _mm512_dpbf16_ps(acc1[k], q1, key);
            }
        }
        for (int k = 0; k < 8; ++k) {
            _mm512_store_ps(s0[k0 + k], acc0[k]);
            _mm512_store_ps(s1[k0 + k], acc1[k]);
        }
    }
}

/* add_values for two blocks at once: the dims in groups of 8, each pair of keys' values
 * broadcast once for both blocks, in add_values' order. */
static inline void add_values_pair(float o0[HEAD_DIM][QUERIES], float o1[HEAD_DIM][QUERIES], const uint16_t *vt,
                                   const uint32_t pt0[KEYS / 2][QUERIES], const uint32_t pt1[KEYS / 2][QUERIES]) {
    for (int d0 = 0; d0 < HEAD_DIM; d0 += 8) {
        __m512 acc0[8], acc1[8];
        for (int i = 0; i < 8; ++i) {
            acc0[i] = _mm512_load_ps(o0[d0 + i]);
            acc1[i] = _mm512_load_ps(o1[d0 + i]);
        }
        for (int j = 0; j < KEYS / 2; ++j) {
            const __m512bh p0 = (__m512bh)_mm512_load_si512(pt0[j]), p1 = (__m512bh)_mm512_load_si512(pt1[j]);
            for (int i = 0; i < 8; ++i) {
                const __m512bh v = broadcast_bf16_pair(vt + (d0 + i) * KEYS + 2 * j);
                acc0[i] = _mm512_dpbf16_ps(acc0[i], p0, v);
                acc1[i] = _mm512_dpbf16_ps(acc1[i], p1, v);
            }
        }
        for (int i = 0; i < 8; ++i) {
            _mm512_store_ps(o0[d0 + i], acc0[i]);
            _mm512_store_ps(o1[d0 + i], acc1[i]);
        }
    }
}

/* 16 queries of a task: their Q^T, O^T, this step's S^T and P^T, softmax, and the keys they see. */
struct query_block {
    struct task t;              /* t.first_query: the block's first */
    int64_t first, last, from;  /* its first query's position, its last key, its first step's first key */
    uint32_t qt[HEAD_DIM / 2][QUERIES] __attribute__((aligned(64)));
    float o[HEAD_DIM][QUERIES] __attribute__((aligned(64)));
    float s[KEYS][QUERIES] __attribute__((aligned(64)));
    uint32_t pt[KEYS / 2][QUERIES] __attribute__((aligned(64)));
    struct lazy_softmax st;
};

/* The block of task t's queries from first_query: Q^T packed, O^T zero, the softmax started. */
static void start_block(const struct prefill *a, const struct task *t, int64_t first_query, struct query_block *b) {
    b->t = (struct task){t->seq, t->head, first_query};
    b->first = a->context_lens[t->seq] + first_query;
    b->last = task_last_key(a, &b->t);
    b->from = first_key(b->first, a->window, KEYS);
    pack_queries(a, &b->t, b->qt);
    for (int d = 0; d < HEAD_DIM; ++d) _mm512_store_ps(b->o[d], _mm512_setzero_ps());
    b->st = lazy_softmax_start(a->scale);
}

/* The block's softmax over its scores of keys k0 .. k0 + KEYS - 1 -> its P^T (O^T rescaled where
 * the maximum rises). */
static void softmax_block(struct query_block *b, int64_t k0, int64_t window) {
    __mmask16 seen[KEYS];
    visible_keys(seen, k0, b->first, b->last, window);
    const float (*scores)[QUERIES] = (const float (*)[QUERIES])b->s;
    if (!lazy_softmax_accept(&b->st, lazy_softmax_pairs(&b->st, scores, seen, KEYS, b->pt))) {
        __m512 alpha;
        if (lazy_softmax_raise(&b->st, masked_max(scores, seen, KEYS), &alpha))
            for (int d = 0; d < HEAD_DIM; ++d) _mm512_store_ps(b->o[d], _mm512_mul_ps(_mm512_load_ps(b->o[d]), alpha));
        b->st.total = _mm512_add_ps(b->st.total, lazy_softmax_pairs(&b->st, scores, seen, KEYS, b->pt));
    }
}

/* Queries first_query .. + 31 (AVX512_TASK_QUERIES) of head `head` of one sequence, as two blocks
 * of 16 (one where the chunk ends first); vt: the sequence's packed V^T. A step of keys both blocks
 * see is scored and summed for both at once (score_keys_pair, add_values_pair), one only the later
 * block sees (past the earlier's last query) for that block alone; every product is added in the
 * same order either way, so a query's result does not depend on its block's partner. */
static void attend_task_avx512(const struct prefill *a, const struct task *t, const uint16_t *vt) {
    const int64_t kvh_count = a->num_kv_heads, kvh = t->head / (a->num_heads / kvh_count);
    const int64_t *table = a->block_tables + t->seq * a->max_blocks;
    const int64_t stride = kvh_count * HEAD_DIM;  /* elements between two keys' cache rows */
    struct query_block blocks[2];
    const int count = t->first_query + QUERIES < a->query_lens[t->seq] ? 2 : 1;
    for (int j = 0; j < count; ++j) start_block(a, t, t->first_query + QUERIES * j, &blocks[j]);
    struct query_block *b0 = &blocks[0], *b1 = &blocks[count - 1];  /* b1 == b0: one block */

    for (int64_t k0 = b0->from; k0 <= b1->last; k0 += KEYS) {
        int sees[2] = {0, 0};
        for (int j = 0; j < count; ++j) sees[j] = k0 >= blocks[j].from && k0 <= blocks[j].last;
        for (int half = 0; half < 2; ++half) {  /* 16 keys from a multiple of 16: one block */
            const int64_t key = k0 + 16 * half;
            const uint16_t *keys = key <= b1->last  /* where the keys are: past the last, nowhere */
                ? a->key_cache + (slot_of(table, key, a->block_size) * kvh_count + kvh) * HEAD_DIM : NULL;
            if (count == 2 && sees[0] && sees[1] && key <= b0->last) {
                score_keys_pair(b0->s + 16 * half, b1->s + 16 * half, b0->qt, b1->qt, keys, stride);
                continue;
            }
            for (int j = 0; j < count; ++j) {
                if (!sees[j]) continue;
                if (key <= blocks[j].last)
                    score_keys(blocks[j].s + 16 * half, blocks[j].qt, keys, stride);
                else  /* no key: masked out, but defined */
                    for (int k = 0; k < 16; ++k) _mm512_store_ps(blocks[j].s[16 * half + k], _mm512_setzero_ps());
            }
        }
        for (int j = 0; j < count; ++j)
            if (sees[j]) softmax_block(&blocks[j], k0, a->window);
        const uint16_t *step_vt = vt + (k0 / KEYS * kvh_count + kvh) * VT_STEP;
        if (count == 2 && sees[0] && sees[1])
            add_values_pair(b0->o, b1->o, step_vt, b0->pt, b1->pt);
        else
            for (int j = 0; j < count; ++j)
                if (sees[j]) add_values(blocks[j].o, step_vt, blocks[j].pt);
    }
    for (int j = 0; j < count; ++j) store_output(a, &blocks[j].t, blocks[j].o, blocks[j].st.total);
}

#endif
