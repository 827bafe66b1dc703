/* Part of cpu_paged_prefill.c: a task on AMX tiles (attend_task_amx, HAVE_PREFILL_AMX where the
 * CPU has them), and paged_prefill_use_amx.
 *
 * Scores are computed transposed, keys down and queries across, and the keys load straight
 * from the cache into the tiles:
 *
 *   S^T (16 keys x 16 queries) = K (16 keys x 64 dims, cache rows) . Q^T (pairs of dims x queries)
 *   O^T (64 dims x 16 queries) += V^T (dims x 32 keys, packed once per call) . P^T (pairs of keys x queries)
 *
 * O^T stays in four accumulator tiles across all keys, Q^T in two: the softmax
 * (lazy_softmax.h) raises its running maximum only when a score exceeds it by
 * more than 2^8 in weight, and only then is O^T stored, rescaled and reloaded. A step's weights
 * are first computed against the running maximum as it stands, which most steps keep
 * (lazy_softmax_accept), so most skip the pass over their scores for the maximum.
 *
 * A tile load holds up the vector work issued after it until it is done, so a step's softmax
 * and its tile work, one after the other, cost their sum. The step's softmax is therefore cut
 * into eight parts, and between them go eight pieces of tile work for the steps beside it: the
 * next step's two score tiles, the previous step's four value products (tile_work_part). The
 * AMX unit then multiplies while the vector units compute weights (whether the two overlap on
 * a given CPU: benchmarks/benchmark_tile_load_overlap.py).
 */
#ifndef VLLM_CPU_PAGED_PREFILL_AMX_H
#define VLLM_CPU_PAGED_PREFILL_AMX_H

#if defined(VLLM_HAVE_AMX) && defined(VLLM_HAVE_LAZY_SOFTMAX)
#define HAVE_PREFILL_AMX 1

static int amx_ready; /* set by paged_prefill_use_amx() */

/* With `enable`, asks for the tile state, and tasks take the AMX copy from then on; without,
 * they take the AVX512 copy. Returns whether AMX is in use. */
int paged_prefill_use_amx(int enable) { return amx_ready = enable && amx_request_tiles(); }

/* Multiplies column q of the four O^T tiles by alpha[q]. */
static inline void rescale_output(__m512 alpha) {
    float o[HEAD_DIM][QUERIES] __attribute__((aligned(64)));
    _tile_stored(0, o[0], 64);
    _tile_stored(1, o[16], 64);
    _tile_stored(2, o[32], 64);
    _tile_stored(3, o[48], 64);
    for (int d = 0; d < HEAD_DIM; ++d) _mm512_store_ps(o[d], _mm512_mul_ps(_mm512_load_ps(o[d]), alpha));
    amx_publish_stores();
    _tile_loadd(0, o[0], 64);
    _tile_loadd(1, o[16], 64);
    _tile_loadd(2, o[32], 64);
    _tile_loadd(3, o[48], 64);
}

/* Tile work for the steps beside the one whose softmax runs: the next step's score tiles and
 * the previous step's value products. Tiles 0-3 hold O^T, 6-7 Q^T; 4 and 5 take the rest. */
struct tile_work {
    const uint16_t *keys[2];          /* the next step's two 16-key tiles' cache rows, or NULL */
    float (*scores)[QUERIES];         /* where their S^T goes (32 rows) */
    const uint16_t *vt;               /* the previous step's V^T, or NULL on the first step */
    const uint32_t (*pt)[QUERIES];    /* and its P^T */
    int64_t row_bytes;                /* between the cache rows of two keys */
};

/* Piece `part` (0-7) of the tile work: S^T of the next step's keys 0-15 over dims 0-31 and then
 * 32-63 (parts 0, 1), O^T tiles 0 and 1 += V^T . P^T (2, 3), the same for keys 16-31 (4, 5)
 * and O^T tiles 2 and 3 (6, 7). (In softmax_step's unrolled loop the switch folds away.) */
static inline void tile_work_part(const struct tile_work *w, int part) {
    const uint16_t *keys = w->keys[part / 4];
    switch (part) {
    case 0: case 4:
        if (!keys) return;
        _tile_zero(4);
        _tile_loadd(5, keys, w->row_bytes);
        _tile_dpbf16ps(4, 5, 6);
        return;
    case 1: case 5:
        if (!keys) return;
        _tile_loadd(5, keys + 32, w->row_bytes);
        _tile_dpbf16ps(4, 5, 7);
        _tile_stored(4, w->scores[part / 4 * 16], 64);
        return;
    case 2:
        if (!w->vt) return;
        _tile_loadd(4, w->pt, 64);
        _tile_loadd(5, w->vt, 64);
        _tile_dpbf16ps(0, 5, 4);
        return;
    case 3:
        if (!w->vt) return;
        _tile_loadd(5, w->vt + 512, 64);
        _tile_dpbf16ps(1, 5, 4);
        return;
    case 6:
        if (!w->vt) return;
        _tile_loadd(4, w->pt, 64);  /* tile 4 held scores since part 2 */
        _tile_loadd(5, w->vt + 1024, 64);
        _tile_dpbf16ps(2, 5, 4);
        return;
    case 7:
        if (!w->vt) return;
        _tile_loadd(5, w->vt + 1536, 64);
        _tile_dpbf16ps(3, 5, 4);
        return;
    }
}

/* All of the tile work at once (before the first step's softmax and after the last's). */
static inline void tile_work_all(const struct tile_work *w) {
    for (int part = 0; part < 8; ++part) tile_work_part(w, part);
}

/* Weights of keys [k0, k0 + 32) from their scores s, as the P^T tile pt (pairs of keys x
 * queries, bf16), with the tile work w done between its parts; O^T is rescaled when the running
 * maximum rises (after w's value products). Keys past `last`, and keys a query must not see,
 * get 0. */
static inline void softmax_step(struct lazy_softmax *st, float s[KEYS][QUERIES], uint32_t pt[KEYS / 2][QUERIES],
                                int64_t k0, int64_t first, int64_t last, int64_t window, const struct tile_work *w) {
    __mmask16 seen[KEYS];
    visible_keys(seen, k0, first, last, window);
    const float (*scores)[16] = (const float (*)[16])s;
    __m512 sums = _mm512_setzero_ps();
    #pragma GCC unroll 8
    for (int part = 0; part < 8; ++part) {  /* four keys' weights, then a piece of tile work */
        sums = _mm512_add_ps(sums, lazy_softmax_pairs(st, scores + 4 * part, seen + 4 * part, 4, pt + 2 * part));
        tile_work_part(w, part);
    }
    if (lazy_softmax_accept(st, sums)) return;
    __m512 alpha;
    if (lazy_softmax_raise(st, masked_max(scores, seen, KEYS), &alpha)) rescale_output(alpha);
    /* Summed in the same parts as above: a lane whose maximum stands gets the same total whether
     * or not another lane of the task (another query, which depends on where the chunk starts)
     * had the step taken back. */
    sums = _mm512_setzero_ps();
    for (int part = 0; part < 8; ++part)
        sums = _mm512_add_ps(sums, lazy_softmax_pairs(st, scores + 4 * part, seen + 4 * part, 4, pt + 2 * part));
    st->total = _mm512_add_ps(st->total, sums);
}

/* The cache rows of a sequence's 16 keys from `key` (a multiple of 16: one block) in KV head
 * kvh; NULL for keys past `last`. */
static inline const uint16_t *key_rows(const struct prefill *a, const int64_t *table, int64_t kvh, int64_t key,
                                       int64_t last) {
    if (key > last) return NULL;
    return a->key_cache + (slot_of(table, key, a->block_size) * a->num_kv_heads + kvh) * HEAD_DIM;
}

/* Queries first_query .. + 15 of head `head` of one sequence; vt: the sequence's packed V^T. */
static void attend_task_amx(const struct prefill *a, const struct task *t, const uint16_t *vt) {
    const int64_t kvh_count = a->num_kv_heads, kvh = t->head / (a->num_heads / kvh_count);
    const int64_t first = a->context_lens[t->seq] + t->first_query, last = task_last_key(a, t);
    const int64_t *table = a->block_tables + t->seq * a->max_blocks, window = a->window;

    uint32_t qt[HEAD_DIM / 2][QUERIES] __attribute__((aligned(64)));
    pack_queries(a, t, qt);
    amx_publish_stores();
    _tile_loadd(6, qt[0], 64);
    _tile_loadd(7, qt[16], 64);

    const int64_t begin = first_key(first, window, KEYS);
    struct lazy_softmax st = lazy_softmax_start(a->scale);
    float s[2][KEYS][QUERIES] __attribute__((aligned(64)));  /* this step's scores, the next's */
    uint32_t pt[2][KEYS / 2][QUERIES] __attribute__((aligned(64)));  /* this step's P^T, the last's */
    const int64_t row_bytes = kvh_count * HEAD_DIM * 2;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    struct tile_work w = {{key_rows(a, table, kvh, begin, last), key_rows(a, table, kvh, begin + 16, last)},
                          s[0], NULL, NULL, row_bytes};
    tile_work_all(&w);  /* the first step's scores */
    for (int64_t k0 = begin, cur = 0; k0 <= last; k0 += KEYS, cur ^= 1) {
        amx_publish_stores();
        w.keys[0] = key_rows(a, table, kvh, k0 + KEYS, last);
        w.keys[1] = key_rows(a, table, kvh, k0 + KEYS + 16, last);
        w.scores = s[cur ^ 1];
        softmax_step(&st, s[cur], pt[cur], k0, first, last, window, &w);
        w.vt = vt + (k0 / KEYS * kvh_count + kvh) * VT_STEP;
        w.pt = pt[cur];
    }
    amx_publish_stores();
    w.keys[0] = w.keys[1] = NULL;
    tile_work_all(&w);  /* the last step's value products */

    float o[HEAD_DIM][QUERIES] __attribute__((aligned(64)));
    _tile_stored(0, o[0], 64);
    _tile_stored(1, o[16], 64);
    _tile_stored(2, o[32], 64);
    _tile_stored(3, o[48], 64);
    store_output(a, t, o, st.total);
}

#else

int paged_prefill_use_amx(int enable) { (void)enable; return 0; }

#endif

#endif
