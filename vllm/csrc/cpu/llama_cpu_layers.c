/*
 * One Llama-family decoder layer for a bf16 step on CPU (decodes, prefill chunks or both), or a
 * float32 step of decodes, in one call.
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
 * within float32's rounding, so a bf16 result moves by one unit at most, and rarely). A float32
 * step (llama_layers_f32) is the same code on float32 rows, its products cpu_gemv_f32.c's, its
 * attention the float32 decode kernel's; it differs from torch's float32 layers in the same two
 * places.
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

/* The kernels' signatures, their tensors in the step's element type (bf16 or float32). */
typedef int (*gemv_fn)(const void *x, const void *w, const void *bias, void *y, int64_t m, int64_t n, int64_t k);
typedef int (*tile_gemm_fn)(const void *x, const void *tiles, const void *bias, void *y, int64_t m, int64_t n,
                            int64_t k);
typedef int (*decode_attend_fn)(const void *query, const void *key_cache, const void *value_cache,
                                const int64_t *block_tables, const int64_t *seq_lens, void *out, int64_t num_seqs,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                int64_t block_size, int64_t max_blocks, int64_t window, float scale);
typedef int (*prefill_attend_fn)(const void *query, const void *key_cache, const void *value_cache,
                                 const int64_t *block_tables, const int64_t *token_offsets, const int64_t *query_lens,
                                 const int64_t *context_lens, void *out, int64_t query_stride,
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
 * in the tile layout (NULL: none), their products, and sizes; the norms' weights and the biases
 * in the step's element type. */
struct layer_weights {
    const void *input_norm, *qkv, *qkv_bias, *o, *o_bias;
    const void *post_norm, *gate_up, *gate_up_bias, *down, *down_bias;
    const void *qkv_tiles, *o_tiles, *gate_up_tiles, *down_tiles;
    struct product qkv_product, o_product, gate_up_product, down_product;
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
};

/* What every layer of a step shares: T tokens, `decodes` of them one per sequence (the first
 * ones, or the rows `decode_rows` names), and `prefills` chunks. */
struct layer_step {
    int64_t tokens;
    const void *cos, *sin;        /* (max_position, D): a row per position; sin's first half negated */
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
static int project(const struct product *P, const void *x, const void *w, const void *tiles, const void *bias,
                   void *y, int64_t m, int64_t n, int64_t k) {
    if (m <= P->gemv_rows) return P->gemv(x, w, bias, y, m, n, k);
    return tiles != NULL && P->tile_gemm != NULL ? P->tile_gemm(x, tiles, bias, y, m, n, k) : 1;
}

/* The layer and the model's layers once per element type (llama_cpu_layer.h): llama_layers for
 * bf16 steps, llama_layers_f32 for float32 ones. */
#define ELEM uint16_t
#define TYPED(name) name
#include "llama_cpu_layer.h"
#undef ELEM
#undef TYPED

#define ELEM float
#define TYPED(name) name##_f32
#include "llama_cpu_layer.h"
#undef ELEM
#undef TYPED
