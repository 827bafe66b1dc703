/* Part of cpu_paged_decode.c: attend_bf16's copy on AMX tiles (HAVE_ATTEND_AMX where the CPU
 * has them), and paged_decode_use_amx. */
#ifndef VLLM_CPU_PAGED_DECODE_AMX_H
#define VLLM_CPU_PAGED_DECODE_AMX_H

#if defined(VLLM_HAVE_AMX) && defined(VLLM_HAVE_LAZY_SOFTMAX)
#define AMX_MAX_HEADS 16   /* the lanes of a score tile */
#define AMX_MAX_GROUP 4    /* query heads per KV head: 4 x 4 value sums in registers */
#define AMX_KEYS 32        /* keys per softmax step: two score tiles */
#define PREFETCH_KEYS 64  /* how far ahead the cache rows are asked for */

static int amx_ready; /* set by paged_decode_use_amx() */

/* With `enable`, asks for the tile state, and the bf16 kernel takes the AMX copy from then on
 * (where it fits); without, it keeps the AVX512 copies. Returns whether AMX is in use. */
int paged_decode_use_amx(int enable) { return amx_ready = enable && amx_request_tiles(); }

/* attend_bf16 on AMX for head_dim 64, all heads at once. The scores of 16 keys for every
 * head are one tile, S^T = K . Q^T, whose K-side operand is the cache rows themselves (all KV
 * heads side by side, 32 dims per product) and whose Q side is block-diagonal (head h has
 * zeros outside its KV head's dims):
 *
 *   S^T (16 keys x heads) = sum over 32-dim chunks c: K[:, c] (16 keys x 32) . Q^T[c] (pairs x heads)
 *
 * The softmax runs down the keys with the heads in the lanes (lazy_softmax.h), and the values
 * are summed in float32 FMAs: a value row's 32-bit words hold pairs of bf16 dims, so a shift
 * and a mask make float32 vectors of its even and its odd dims, and each head's weight (a
 * float32, not rounded to bf16) is broadcast against them. The sums of a group's heads stay in
 * registers, in that even/odd order (`unpacked_dim`) until they are written out. FMAs rather
 * than bf16 dot products over pairs of keys: vdpbf16ps does twice an FMA's products but issues
 * once per two cycles where an FMA issues twice per cycle, so the dot products do half the work
 * per cycle. The rows of the keys PREFETCH_KEYS ahead are asked for while the values are summed
 * (sum_values). */
static inline int64_t unpacked_dim(int64_t v, int64_t lane) {
    /* vector v of a head's four: 0, 1 = the even, the odd dims of 0-31; 2, 3 those of 32-63 */
    return 32 * (v / 2) + 2 * lane + v % 2;
}

/* The scores of the next step's keys [k0, k0 + 32) for every head, made piece by piece between
 * this step's value sums: a tile load holds up the vector work issued after it, so made all at
 * once they would add their time to the sums' instead of overlapping them. */
struct score_work {
    const uint16_t *k_lo, *k_hi;  /* cache rows of keys k0 and k0 + 16; NULL past the range */
    int64_t row_bytes;
    uint32_t (*qt)[16][16];
};

static inline struct score_work score_work_amx(const uint16_t *key_cache, const int64_t *table, int64_t k0,
                                               int64_t last, int64_t block_size, int64_t row, uint32_t qt[][16][16]) {
    struct score_work w = {NULL, NULL, 2 * row, qt};
    if (k0 < last) w.k_lo = key_cache + slot_of(table, k0, block_size) * row;
    if (k0 + 16 < last) w.k_hi = key_cache + slot_of(table, k0 + 16, block_size) * row;
    return w;
}

/* Piece c (dims 32 c .. 32 c + 31) of w's scores, into tiles 0 (keys k0 ..) and 1 (k0 + 16 ..);
 * piece 0 clears them. Even and odd pieces use different operand tiles, so that each product
 * waits on fewer others. */
static inline void score_piece_amx(const struct score_work *w, int64_t c) {
    if (!w->k_lo) return;
    if (c == 0) {
        _tile_zero(0);
        _tile_zero(1);
    }
    if (c % 2 == 0) {
        _tile_loadd(4, w->qt[c], 64);
        _tile_loadd(2, w->k_lo + 32 * c, w->row_bytes);
        _tile_dpbf16ps(0, 2, 4);
        if (w->k_hi) {
            _tile_loadd(3, w->k_hi + 32 * c, w->row_bytes);
            _tile_dpbf16ps(1, 3, 4);
        }
    } else {
        _tile_loadd(7, w->qt[c], 64);
        _tile_loadd(5, w->k_lo + 32 * c, w->row_bytes);
        _tile_dpbf16ps(0, 5, 7);
        if (w->k_hi) {
            _tile_loadd(6, w->k_hi + 32 * c, w->row_bytes);
            _tile_dpbf16ps(1, 6, 7);
        }
    }
}

static inline void store_scores_amx(int64_t k0, int64_t last, float s[AMX_KEYS][16]) {
    _tile_stored(0, s[0], 64);
    if (k0 + 16 < last) _tile_stored(1, s[16], 64);
}

/* The cache rows of 32 keys PREFETCH_KEYS ahead: two runs of 16 rows, bytes[half] long
 * (0: none), in the key and the value cache. */
struct ahead {
    const char *k[2], *v[2];
    int64_t bytes[2];
};

/* Adds the values of keys [k0, k0 + 32) to the sums of KV head g's `group` query heads:
 * values[0] and values[1] are the cache rows of keys k0 and k0 + 16, weights[j] the weights of
 * key k0 + j (0 for keys outside the range, whose rows may hold anything, even NaN, and are not
 * read). group is a constant where this is inlined: with a run-time group, GCC kept flags and
 * mask registers for which sums were loaded, ~20 instructions a key. While it runs, it asks for
 * this KV head's lines of the rows ahead, so that the requests are spread over all the passes
 * (in one burst they fill the miss queue and the loop waits on them), and it makes KV head g's
 * two pieces of the next step's scores (2 g and 2 g + 1: a step has two per KV head). */
static inline __attribute__((always_inline)) void sum_values(
        const uint16_t *const values[2], const float weights[AMX_KEYS][16], const __mmask16 *keep,
        float acc[][64], int64_t g, int64_t group, int64_t row, const struct ahead *ahead,
        const struct score_work *next) {
    const __m512i odd_dims = _mm512_set1_epi32((int)0xffff0000u);
    __m512 sums[AMX_MAX_GROUP][4];
    for (int64_t hh = 0; hh < group; ++hh)
        for (int v = 0; v < 4; ++v) sums[hh][v] = _mm512_load_ps(&acc[g * group + hh][16 * v]);
    for (int64_t j = 0; j < AMX_KEYS; ++j) {
        const int64_t half = j / 16, line = (j % 16) * row * 2 + g * 128; /* this head's 2 lines */
        if (line < ahead->bytes[half]) {
            _mm_prefetch(ahead->k[half] + line, _MM_HINT_T1);
            _mm_prefetch(ahead->k[half] + line + 64, _MM_HINT_T1);
            _mm_prefetch(ahead->v[half] + line, _MM_HINT_T1);
            _mm_prefetch(ahead->v[half] + line + 64, _MM_HINT_T1);
        }
        if (j == 8) score_piece_amx(next, 2 * g);
        if (j == 24) score_piece_amx(next, 2 * g + 1);
        if (!keep[j]) continue;
        const uint16_t *value = values[half] + (j % 16 * row + g * 64);  /* key k0 + j */
        const __m512i lo = _mm512_loadu_si512(value), hi = _mm512_loadu_si512(value + 32);
        const __m512 dims[4] = {_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)),
                                _mm512_castsi512_ps(_mm512_and_si512(lo, odd_dims)),
                                _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)),
                                _mm512_castsi512_ps(_mm512_and_si512(hi, odd_dims))};
        for (int64_t hh = 0; hh < group; ++hh) {
            const __m512 w = _mm512_set1_ps(weights[j][g * group + hh]);
            for (int v = 0; v < 4; ++v) sums[hh][v] = _mm512_fmadd_ps(dims[v], w, sums[hh][v]);
        }
    }
    for (int64_t hh = 0; hh < group; ++hh)
        for (int v = 0; v < 4; ++v) _mm512_store_ps(&acc[g * group + hh][16 * v], sums[hh][v]);
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
    float acc[AMX_MAX_HEADS][64] __attribute__((aligned(64)));  /* value sums, dims in unpacked_dim order */
    memset(acc, 0, sizeof acc);
    float s[2][AMX_KEYS][16] __attribute__((aligned(64)));  /* this step's scores, the next's */
    float weights[AMX_KEYS][16] __attribute__((aligned(64)));  /* [key][head] */
    struct lazy_softmax st = lazy_softmax_start(scale);
    const __mmask16 heads = (__mmask16)((1u << num_heads) - 1);
    amx_configure_full_tiles(); /* 0, 1: scores; 2, 3, 5, 6: keys; 4, 7: queries */
    const int64_t begin = first / 16 * 16;
    const struct score_work first_scores = score_work_amx(key_cache, table, begin, last, block_size, row, qt);
    for (int64_t c = 0; c < chunks; ++c) score_piece_amx(&first_scores, c);
    store_scores_amx(begin, last, s[0]);
    for (int64_t k0 = begin, cur = 0; k0 < last; k0 += AMX_KEYS, cur ^= 1) {
        /* The next step's score tiles are made during this step's value sums (sum_values) and
         * stored after them. */
        const int64_t next = k0 + AMX_KEYS;
        const struct score_work next_scores = score_work_amx(key_cache, table, next, last, block_size, row, qt);
        struct ahead ahead = {{NULL, NULL}, {NULL, NULL}, {0, 0}}; /* asked for by sum_values */
        for (int64_t half = 0; half < 2 && k0 + PREFETCH_KEYS + 16 * half < last; ++half) {
            const int64_t k = k0 + PREFETCH_KEYS + 16 * half;
            ahead.k[half] = (const char *)(key_cache + slot_of(table, k, block_size) * row);
            ahead.v[half] = (const char *)(value_cache + slot_of(table, k, block_size) * row);
            ahead.bytes[half] = (last - k < 16 ? last - k : 16) * row * 2;
        }
        __mmask16 keep[AMX_KEYS];
        for (int64_t j = 0; j < AMX_KEYS; ++j) keep[j] = k0 + j >= first && k0 + j < last ? heads : 0;
        const float (*scores)[16] = (const float (*)[16])s[cur];
        if (!lazy_softmax_accept(&st, lazy_softmax_rows(&st, scores, keep, AMX_KEYS, weights))) {
            __m512 alpha;
            if (lazy_softmax_raise(&st, masked_max(scores, keep, AMX_KEYS), &alpha)) {
                float factor[16] __attribute__((aligned(64)));
                _mm512_store_ps(factor, alpha);
                for (int64_t h = 0; h < num_heads; ++h)
                    for (int v = 0; v < 4; ++v)
                        _mm512_store_ps(&acc[h][16 * v], _mm512_mul_ps(_mm512_load_ps(&acc[h][16 * v]),
                                                                       _mm512_set1_ps(factor[h])));
            }
            st.total = _mm512_add_ps(st.total, lazy_softmax_rows(&st, scores, keep, AMX_KEYS, weights));
        }
        /* Each 16 keys from a multiple of 16 lie in one block (block_size % 16 == 0): their
         * value rows follow each other. (Past `last` no row is read.) */
        const uint16_t *values[2] = {value_cache + slot_of(table, k0, block_size) * row, NULL};
        values[1] = k0 + 16 < last ? value_cache + slot_of(table, k0 + 16, block_size) * row : values[0];
        const float (*w)[16] = (const float (*)[16])weights;
        for (int64_t g = 0; g < num_kv_heads; ++g) {
            switch (group) {  /* a copy for each group size up to AMX_MAX_GROUP */
            case 1: sum_values(values, w, keep, acc, g, 1, row, &ahead, &next_scores); break;
            case 2: sum_values(values, w, keep, acc, g, 2, row, &ahead, &next_scores); break;
            case 3: sum_values(values, w, keep, acc, g, 3, row, &ahead, &next_scores); break;
            default: sum_values(values, w, keep, acc, g, 4, row, &ahead, &next_scores); break;
            }
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
int paged_decode_use_amx(int enable) { (void)enable; return 0; }
#endif

#endif
