/*
 * One Llama-family decoder layer for a step of a few decode tokens (bf16), in one call.
 *
 * At batch 1 a layer is ~7 MB of weights streamed in ~0.3 ms by the GEMV kernel; run as torch
 * ops, the norms, rotary, residual adds, cache write and attention between the four GEMVs cost
 * as much again in dispatch. Here they are a few microseconds of C on T <= 32 rows, and
 * the products and attention are the kernels of cpu_gemv.c (up to 4 rows), cpu_tile_gemm.c (up
 * to 32; SiLU-and-multiply in gate_up's epilogue there) and cpu_paged_decode.c, passed in as
 * function pointers (each kernel keeps one source).
 *
 * Every intermediate is rounded to bf16 where the torch layer rounds it (eager bf16 ops), so
 * the two paths differ only in the order of a norm's float32 sum and in the exp of SiLU (both
 * within float32's rounding, so a bf16 result moves by one unit at most, and rarely).
 *
 *   hidden += o_proj(attention(rope(q), rope(k) -> cache, v -> cache))   q, k, v = qkv(norm(hidden))
 *   hidden += down(silu(gate) * up)                                      gate, up = gate_up(norm(hidden))
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "layer_ops.h"

typedef int (*gemv_fn)(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                       int64_t m, int64_t n, int64_t k);
typedef int (*tile_gemm_fn)(const uint16_t *x, const uint16_t *tiles, const uint16_t *bias,
                            uint16_t *y, int64_t m, int64_t n, int64_t k);
typedef int (*attend_fn)(const uint16_t *query, const uint16_t *key_cache,
                         const uint16_t *value_cache, const int64_t *block_tables,
                         const int64_t *seq_lens, uint16_t *out, int64_t num_seqs,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, int64_t max_blocks, int64_t window, float scale);

/* A layer's weights (contiguous, nn.Linear's (out, in) layout; biases may be NULL), their copies
 * in the tile layout (NULL: none), and sizes. */
struct decode_layer {
    const uint16_t *input_norm, *qkv, *qkv_bias, *o, *o_bias;
    const uint16_t *post_norm, *gate_up, *gate_up_bias, *down, *down_bias;
    const uint16_t *qkv_tiles, *o_tiles, *gate_up_tiles, *down_tiles;
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
};

/* What every layer of a step shares: T sequences with one token each. */
struct decode_step {
    int64_t tokens;
    const uint16_t *cos, *sin;    /* (T, D): rows of the tokens' positions; sin's first half negated */
    const int64_t *slots;         /* (T,): cache slot of each token's key and value */
    const int64_t *block_tables;  /* (T, max_blocks) */
    const int64_t *seq_lens;      /* (T,): keys per sequence, this token included */
    int64_t max_blocks, block_size, window;
    int64_t gemv_rows;            /* up to this many rows the GEMV, above it the tile GEMM */
    gemv_fn gemv;
    tile_gemm_fn tile_gemm;       /* NULL: none */
    tile_gemm_fn tile_gemm_silu_mul;  /* gate_up's product with SiLU-and-multiply as its epilogue */
    attend_fn attend;
};

/* y (m, n) = x (m, k) @ W^T + bias, on the kernel for m rows. */
static int project(const struct decode_step *S, const uint16_t *x, const uint16_t *w,
                   const uint16_t *tiles, const uint16_t *bias, uint16_t *y, int64_t m, int64_t n,
                   int64_t k) {
    if (m <= S->gemv_rows) return S->gemv(x, w, bias, y, m, n, k);
    return tiles != NULL && S->tile_gemm != NULL ? S->tile_gemm(x, tiles, bias, y, m, n, k) : 1;
}

/* hidden: (T, hidden) bf16, updated in place; caches: (num_blocks, block_size, KVH, D). */
int llama_decode_layer(const struct decode_layer *L, const struct decode_step *S, uint16_t *hidden,
                       uint16_t *key_cache, uint16_t *value_cache) {
    const int64_t t = S->tokens, h = L->hidden, d = L->head_dim, inter = L->intermediate;
    const int64_t q_size = L->heads * d, kv_size = L->kv_heads * d, qkv_size = q_size + 2 * kv_size;
    const int64_t widest = qkv_size > 2 * inter ? qkv_size : 2 * inter;
    uint16_t *buf = malloc(sizeof(uint16_t) * t * (2 * h + widest + inter + q_size * 2));
    if (buf == NULL) return 2;
    uint16_t *normed = buf, *proj = normed + t * h, *wide = proj + t * h;
    uint16_t *act = wide + t * widest, *query = act + t * inter, *attn = query + t * q_size;
    int status = 0;

    #pragma omp parallel for schedule(static) if (t >= 8)
    for (int64_t r = 0; r < t; ++r) rms_norm_row(hidden + r * h, L->input_norm, normed + r * h, h, L->eps);
    status |= project(S, normed, L->qkv, L->qkv_tiles, L->qkv_bias, wide, t, qkv_size, h);      /* (T, q + 2 kv) */
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < t; ++r) {
        const uint16_t *row = wide + r * qkv_size, *cos = S->cos + r * d, *sin = S->sin + r * d;
        for (int64_t head = 0; head < L->heads; ++head)
            rotate(row + head * d, cos, sin, query + (r * L->heads + head) * d, d);
        if (S->slots[r] < 0) continue;  /* the sentinel slot: nothing to keep */
        uint16_t *k_dst = key_cache + S->slots[r] * kv_size, *v_dst = value_cache + S->slots[r] * kv_size;
        for (int64_t head = 0; head < L->kv_heads; ++head)
            rotate(row + q_size + head * d, cos, sin, k_dst + head * d, d);
        memcpy(v_dst, row + q_size + kv_size, sizeof(uint16_t) * kv_size);
    }
    status |= S->attend(query, key_cache, value_cache, S->block_tables, S->seq_lens, attn, t,
                        L->heads, L->kv_heads, d, S->block_size, S->max_blocks, S->window, L->scale);
    status |= project(S, attn, L->o, L->o_tiles, L->o_bias, proj, t, h, q_size);               /* (T, hidden) */
    add_into(hidden, proj, t * h);

    #pragma omp parallel for schedule(static) if (t >= 8)
    for (int64_t r = 0; r < t; ++r) rms_norm_row(hidden + r * h, L->post_norm, normed + r * h, h, L->eps);
    /* (T, I) in one pass where the tile GEMM runs gate_up and its gate and up blocks pair up */
    if (t > S->gemv_rows && L->gate_up_tiles != NULL && S->tile_gemm_silu_mul != NULL && inter % 16 == 0) {
        status |= S->tile_gemm_silu_mul(normed, L->gate_up_tiles, L->gate_up_bias, act, t, 2 * inter, h);
    } else {
        status |= project(S, normed, L->gate_up, L->gate_up_tiles, L->gate_up_bias, wide, t, 2 * inter, h);  /* (T, 2I) */
        #pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < t; ++r) silu_mul_row(wide + r * 2 * inter, act + r * inter, inter);
    }
    status |= project(S, act, L->down, L->down_tiles, L->down_bias, proj, t, h, inter);           /* (T, hidden) */
    add_into(hidden, proj, t * h);
    free(buf);
    return status;
}
