/*
 * One Llama-family decoder layer for a bf16 step on CPU (decodes, prefill chunks or both), in
 * one call.
 *
 * At batch 1 a layer's time should be the GEMV kernel streaming its weights; run as torch ops,
 * the norms, rotary, residual adds, cache write and attention between the four GEMVs each pay a
 * dispatch and an allocation, which for a small model costs about as much as the streaming. A
 * prefill chunk's layer is mostly products, but its ~15 torch ops and ctypes calls, each
 * allocating its output, still add a fixed cost to every layer of every step. Here those steps
 * are C on the step's rows, with one scratch buffer for all, and the products
 * and attention are the engine's kernels, passed in as function pointers (each kernel keeps one
 * source): cpu_gemv.c (up to 4 rows), cpu_tile_gemm.c (more; SiLU-and-multiply in gate_up's
 * epilogue there), cpu_paged_decode.c and cpu_paged_prefill.c.
 *
 * Every intermediate is rounded to bf16 where the torch layer rounds it (eager bf16 ops), so
 * the two paths differ only in the order of a norm's float32 sum and in the exp of SiLU (both
 * within float32's rounding, so a bf16 result moves by one unit at most, and rarely).
 *
 *   hidden += o_proj(attention(rope(q), rope(k) -> cache, v -> cache))   q, k, v = qkv(norm(hidden))
 *   hidden += down(silu(gate) * up)                                      gate, up = gate_up(norm(hidden))
 *
 * A step's tokens: its decodes (one token per sequence; first, unless the step names their rows),
 * then its prefill chunks. llama_layers runs all of a model's layers for a step, and its final
 * norm, in one call.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "layer_ops.h"

typedef int (*gemv_fn)(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                       int64_t m, int64_t n, int64_t k);
typedef int (*tile_gemm_fn)(const uint16_t *x, const uint16_t *tiles, const uint16_t *bias,
                            uint16_t *y, int64_t m, int64_t n, int64_t k);
typedef int (*decode_attend_fn)(const uint16_t *query, const uint16_t *key_cache,
                                const uint16_t *value_cache, const int64_t *block_tables,
                                const int64_t *seq_lens, uint16_t *out, int64_t num_seqs,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                int64_t block_size, int64_t max_blocks, int64_t window, float scale);
typedef int (*prefill_attend_fn)(const uint16_t *query, const uint16_t *key_cache,
                                 const uint16_t *value_cache, const int64_t *block_tables,
                                 const int64_t *token_offsets, const int64_t *query_lens,
                                 const int64_t *context_lens, uint16_t *out, int64_t query_stride,
                                 int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                 int64_t window, float scale);

/* How one weight's product runs: `gemv` up to gemv_rows rows of x, `tile_gemm` on the weight's
 * tile copy above (NULL: none). A model's weights may differ (bf16 beside GGUF blocks, or GGUF
 * blocks of different types), so each weight has its own. */
struct product {
    gemv_fn gemv;
    int64_t gemv_rows;
    tile_gemm_fn tile_gemm;
};

/* A layer's weights (contiguous, nn.Linear's (out, in) layout; biases may be NULL), their copies
 * in the tile layout (NULL: none), their products, and sizes. */
struct layer_weights {
    const uint16_t *input_norm, *qkv, *qkv_bias, *o, *o_bias;
    const uint16_t *post_norm, *gate_up, *gate_up_bias, *down, *down_bias;
    const uint16_t *qkv_tiles, *o_tiles, *gate_up_tiles, *down_tiles;
    struct product qkv_product, o_product, gate_up_product, down_product;
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
};

/* What every layer of a step shares: T tokens, `decodes` of them one per sequence (the first
 * ones, or the rows `decode_rows` names), and `prefills` chunks. */
struct layer_step {
    int64_t tokens;
    const uint16_t *cos, *sin;    /* (max_position, D): a row per position; sin's first half negated */
    const int64_t *positions;     /* (T,): each token's position, its row of cos and sin */
    int64_t max_position;
    const int64_t *slots;         /* (T,): cache slot of each token's key and value; < 0: none */
    int64_t decodes;
    const int64_t *decode_rows;          /* (decodes,): each decode's row; NULL: rows 0 .. decodes - 1 */
    const int64_t *decode_block_tables;  /* (decodes, decode_max_blocks) */
    const int64_t *seq_lens;             /* (decodes,): keys per sequence, its token included */
    int64_t decode_max_blocks;
    int64_t prefills;
    const int64_t *prefill_block_tables;  /* (prefills, prefill_max_blocks) */
    const int64_t *token_offsets, *query_lens, *context_lens;  /* (prefills,) each */
    int64_t prefill_max_blocks;
    int64_t block_size, window;
    tile_gemm_fn tile_gemm_silu_mul;  /* gate_up's tile GEMM with SiLU-and-multiply as its epilogue */
    decode_attend_fn attend_decodes;
    prefill_attend_fn attend_prefills;  /* NULL: none (then the step has no prefills) */
};

/* llama_layers' status for a position outside the rotary tables (the kernels' failures are positive). */
#define LLAMA_BAD_POSITION (-1)

/* The widest intermediate row: q|k|v or gate|up. */
static int64_t widest_row(const struct layer_weights *L) {
    const int64_t qkv_size = (L->heads + 2 * L->kv_heads) * L->head_dim;
    return qkv_size > 2 * L->intermediate ? qkv_size : 2 * L->intermediate;
}

/* The scratch rows one layer needs for T tokens, in bf16 elements. */
int64_t llama_layer_workspace(const struct layer_weights *L, int64_t tokens) {
    return tokens * (2 * L->hidden + widest_row(L) + L->intermediate + 4 * L->heads * L->head_dim);
}

/* The step's rows r = 0 .. t - 1 through the statements given, shared out among the threads
 * from PARALLEL_ROWS rows on. Below, they run on the calling thread outside any OpenMP region:
 * a region costs more than a few rows of these steps, even one its `if` clause keeps to one
 * thread. */
#define PARALLEL_ROWS 8
#define FOR_EACH_ROW(t, r, ...)                                                                    \
    do {                                                                                           \
        if ((t) >= PARALLEL_ROWS) {                                                                \
            _Pragma("omp parallel for schedule(static)")                                           \
            for (int64_t r = 0; r < (t); ++r) { __VA_ARGS__ }                                      \
        } else {                                                                                   \
            for (int64_t r = 0; r < (t); ++r) { __VA_ARGS__ }                                      \
        }                                                                                          \
    } while (0)

/* y (m, n) = x (m, k) @ W^T + bias, on W's kernel for m rows. */
static int project(const struct product *P, const uint16_t *x, const uint16_t *w,
                   const uint16_t *tiles, const uint16_t *bias, uint16_t *y, int64_t m, int64_t n,
                   int64_t k) {
    if (m <= P->gemv_rows) return P->gemv(x, w, bias, y, m, n, k);
    return tiles != NULL && P->tile_gemm != NULL ? P->tile_gemm(x, tiles, bias, y, m, n, k) : 1;
}

/* hidden: (T, hidden) bf16, updated in place; caches: (num_blocks, block_size, KVH, D);
 * workspace: llama_layer_workspace(L, T) elements. */
static int llama_layer(const struct layer_weights *L, const struct layer_step *S, uint16_t *hidden,
                       uint16_t *key_cache, uint16_t *value_cache, uint16_t *workspace) {
    const int64_t t = S->tokens, h = L->hidden, d = L->head_dim, inter = L->intermediate;
    const int64_t q_size = L->heads * d, kv_size = L->kv_heads * d, qkv_size = q_size + 2 * kv_size;
    uint16_t *normed = workspace, *proj = normed + t * h, *wide = proj + t * h;
    uint16_t *act = wide + t * widest_row(L), *query = act + t * inter, *attn = query + t * q_size;
    uint16_t *decode_query = attn + t * q_size, *decode_attn = decode_query + t * q_size;
    int status = 0;

    FOR_EACH_ROW(t, r, rms_norm_row(hidden + r * h, L->input_norm, normed + r * h, h, L->eps););
    status |= project(&L->qkv_product, normed, L->qkv, L->qkv_tiles, L->qkv_bias, wide, t, qkv_size,
                      h);                                                                 /* (T, q + 2 kv) */
    FOR_EACH_ROW(t, r,
        const uint16_t *row = wide + r * qkv_size;
        const uint16_t *cos = S->cos + S->positions[r] * d, *sin = S->sin + S->positions[r] * d;
        for (int64_t head = 0; head < L->heads; ++head)
            rotate(row + head * d, cos, sin, query + (r * L->heads + head) * d, d);
        if (S->slots[r] < 0) continue;  /* the sentinel slot: nothing to keep */
        uint16_t *k_dst = key_cache + S->slots[r] * kv_size, *v_dst = value_cache + S->slots[r] * kv_size;
        for (int64_t head = 0; head < L->kv_heads; ++head)
            rotate(row + q_size + head * d, cos, sin, k_dst + head * d, d);
        memcpy(v_dst, row + q_size + kv_size, sizeof(uint16_t) * kv_size);
    );
    if (S->decodes > 0) {  /* (decodes, H, D): the kernel takes them as consecutive rows */
        const uint16_t *q = query;
        uint16_t *out = attn;
        if (S->decode_rows != NULL) {
            for (int64_t i = 0; i < S->decodes; ++i)
                memcpy(decode_query + i * q_size, query + S->decode_rows[i] * q_size, sizeof(uint16_t) * q_size);
            q = decode_query;
            out = decode_attn;
        }
        status |= S->attend_decodes(q, key_cache, value_cache, S->decode_block_tables, S->seq_lens, out,
                                    S->decodes, L->heads, L->kv_heads, d, S->block_size,
                                    S->decode_max_blocks, S->window, L->scale);
        if (S->decode_rows != NULL)
            for (int64_t i = 0; i < S->decodes; ++i)
                memcpy(attn + S->decode_rows[i] * q_size, decode_attn + i * q_size, sizeof(uint16_t) * q_size);
    }
    if (S->prefills > 0)  /* the chunks' rows of (T, H, D) */
        status |= S->attend_prefills == NULL ? 1 : S->attend_prefills(
            query, key_cache, value_cache, S->prefill_block_tables, S->token_offsets, S->query_lens,
            S->context_lens, attn, q_size, S->prefills, L->heads, L->kv_heads, d, S->block_size,
            S->prefill_max_blocks, S->window, L->scale);
    status |= project(&L->o_product, attn, L->o, L->o_tiles, L->o_bias, proj, t, h, q_size);    /* (T, hidden) */

    FOR_EACH_ROW(t, r,
        add_into(hidden + r * h, proj + r * h, h);
        rms_norm_row(hidden + r * h, L->post_norm, normed + r * h, h, L->eps);
    );
    /* (T, I) in one pass where the tile GEMM runs gate_up and its gate and up blocks pair up */
    if (t > L->gate_up_product.gemv_rows && L->gate_up_tiles != NULL && S->tile_gemm_silu_mul != NULL &&
        inter % 16 == 0) {
        status |= S->tile_gemm_silu_mul(normed, L->gate_up_tiles, L->gate_up_bias, act, t, 2 * inter, h);
    } else {
        status |= project(&L->gate_up_product, normed, L->gate_up, L->gate_up_tiles, L->gate_up_bias, wide, t,
                          2 * inter, h);                                                              /* (T, 2I) */
        FOR_EACH_ROW(t, r, silu_mul_row(wide + r * 2 * inter, act + r * inter, inter););
    }
    status |= project(&L->down_product, act, L->down, L->down_tiles, L->down_bias, proj, t, h,
                      inter);                                                               /* (T, hidden) */
    FOR_EACH_ROW(t, r, add_into(hidden + r * h, proj + r * h, h););
    return status;
}

/* The `count` layers of a model for one step, in order, each on its own caches, then the model's
 * final norm (weight `norm`) in place: hidden goes in as the tokens' embeddings and comes out as
 * what the LM head reads. Returns LLAMA_BAD_POSITION, before any layer runs, when a position has
 * no row of cos and sin; else stops at the first layer a kernel rejects (its status). One call
 * for the model: a call per layer from Python costs more than a batch-1 layer's norms and
 * residual adds, and so does each torch op around the layers (the rotary lookup, the final
 * norm), dispatched on caches that the weights streaming through the step have emptied. */
int llama_layers(const struct layer_weights *layers, int64_t count, const uint16_t *norm, float eps,
                 const struct layer_step *S, uint16_t *hidden, uint16_t *const *key_caches,
                 uint16_t *const *value_caches, uint16_t *workspace) {
    for (int64_t r = 0; r < S->tokens; ++r)
        if (S->positions[r] < 0 || S->positions[r] >= S->max_position) return LLAMA_BAD_POSITION;
    for (int64_t i = 0; i < count; ++i) {
        const int status = llama_layer(layers + i, S, hidden, key_caches[i], value_caches[i], workspace);
        if (status != 0) return status;
    }
    const int64_t h = layers[0].hidden;
    FOR_EACH_ROW(S->tokens, r, rms_norm_row(hidden + r * h, norm, hidden + r * h, h, eps););
    return 0;
}
