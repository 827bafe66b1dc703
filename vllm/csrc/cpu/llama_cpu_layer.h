/*
 * Part of llama_cpu_layers.c: its decoder layer and a model's layers for one element type ELEM,
 * included once per type, with TYPED(name) naming each function of that type: layer_ops.h's bf16
 * steps and llama_layers as they are for ELEM = uint16_t (bf16), their _f32 twins for
 * ELEM = float.
 */

/* hidden: (T, hidden), updated in place; caches: (num_blocks, block_size, KVH, D);
 * workspace: llama_layer_workspace(L, T) elements. */
static int TYPED(llama_layer)(const struct layer_weights *L, const struct layer_step *S, ELEM *hidden,
                              ELEM *key_cache, ELEM *value_cache, ELEM *workspace) {
    const int64_t t = S->tokens, h = L->hidden, d = L->head_dim, inter = L->intermediate;
    const int64_t q_size = L->heads * d, kv_size = L->kv_heads * d, qkv_size = q_size + 2 * kv_size;
    ELEM *normed = workspace, *proj = normed + t * h, *wide = proj + t * h;
    ELEM *act = wide + t * widest_row(L), *query = act + t * inter, *attn = query + t * q_size;
    ELEM *decode_query = attn + t * q_size, *decode_attn = decode_query + t * q_size;
    int status = 0;

    FOR_EACH_ROW(t, r, TYPED(rms_norm_row)(hidden + r * h, L->input_norm, normed + r * h, h, L->eps););
    status |= project(&L->qkv_product, normed, L->qkv, L->qkv_tiles, L->qkv_bias, wide, t, qkv_size,
                      h);                                                                 /* (T, q + 2 kv) */
    FOR_EACH_ROW(t, r,
        const ELEM *row = wide + r * qkv_size;
        const ELEM *cos = (const ELEM *)S->cos + S->positions[r] * d, *sin = (const ELEM *)S->sin + S->positions[r] * d;
        for (int64_t head = 0; head < L->heads; ++head)
            TYPED(rotate)(row + head * d, cos, sin, query + (r * L->heads + head) * d, d);
        if (S->slots[r] < 0) continue;  /* the sentinel slot: nothing to keep */
        ELEM *k_dst = key_cache + S->slots[r] * kv_size, *v_dst = value_cache + S->slots[r] * kv_size;
        for (int64_t head = 0; head < L->kv_heads; ++head)
            TYPED(rotate)(row + q_size + head * d, cos, sin, k_dst + head * d, d);
        memcpy(v_dst, row + q_size + kv_size, sizeof(ELEM) * kv_size);
    );
    if (S->decodes > 0) {  /* (decodes, H, D): the kernel takes them as consecutive rows */
        const ELEM *q = query;
        ELEM *out = attn;
        if (S->decode_rows != NULL) {
            for (int64_t i = 0; i < S->decodes; ++i)
                memcpy(decode_query + i * q_size, query + S->decode_rows[i] * q_size, sizeof(ELEM) * q_size);
            q = decode_query;
            out = decode_attn;
        }
        status |= S->attend_decodes(q, key_cache, value_cache, S->decode_block_tables, S->seq_lens, out,
                                    S->decodes, L->heads, L->kv_heads, d, S->block_size,
                                    S->decode_max_blocks, S->window, L->scale);
        if (S->decode_rows != NULL)
            for (int64_t i = 0; i < S->decodes; ++i)
                memcpy(attn + S->decode_rows[i] * q_size, decode_attn + i * q_size, sizeof(ELEM) * q_size);
    }
    if (S->prefills > 0)  /* the chunks' rows of (T, H, D) */
        status |= S->attend_prefills == NULL ? 1 : S->attend_prefills(
            query, key_cache, value_cache, S->prefill_block_tables, S->token_offsets, S->query_lens,
            S->context_lens, attn, q_size, S->prefills, L->heads, L->kv_heads, d, S->block_size,
            S->prefill_max_blocks, S->window, L->scale);
    status |= project(&L->o_product, attn, L->o, L->o_tiles, L->o_bias, proj, t, h, q_size);    /* (T, hidden) */

    FOR_EACH_ROW(t, r,
        TYPED(add_into)(hidden + r * h, proj + r * h, h);
        TYPED(rms_norm_row)(hidden + r * h, L->post_norm, normed + r * h, h, L->eps);
    );
    /* (T, I) in one pass where the tile GEMM runs gate_up and its gate and up blocks pair up */
    if (t > L->gate_up_product.gemv_rows && L->gate_up_tiles != NULL && S->tile_gemm_silu_mul != NULL &&
        inter % 16 == 0) {
        status |= S->tile_gemm_silu_mul(normed, L->gate_up_tiles, L->gate_up_bias, act, t, 2 * inter, h);
    } else {
        status |= project(&L->gate_up_product, normed, L->gate_up, L->gate_up_tiles, L->gate_up_bias, wide, t,
                          2 * inter, h);                                                              /* (T, 2I) */
        FOR_EACH_ROW(t, r, TYPED(silu_mul_row)(wide + r * 2 * inter, act + r * inter, inter););
    }
    status |= project(&L->down_product, act, L->down, L->down_tiles, L->down_bias, proj, t, h,
                      inter);                                                               /* (T, hidden) */
    FOR_EACH_ROW(t, r, TYPED(add_into)(hidden + r * h, proj + r * h, h););
    return status;
}

/* The `count` layers of a model for one step, in order, each on its own caches, then the model's
 * final norm (weight `norm`) in place: hidden goes in as the tokens' embeddings and comes out as
 * what the LM head reads. Returns LLAMA_BAD_POSITION, before any layer runs, when a position has
 * no row of cos and sin; else stops at the first layer a kernel rejects (its status). One call
 * for the model: a call per layer from Python costs more than a batch-1 layer's norms and
 * residual adds, and so does each torch op around the layers (the rotary lookup, the final
 * norm), dispatched on caches that the weights streaming through the step have emptied. */
int TYPED(llama_layers)(const struct layer_weights *layers, int64_t count, const ELEM *norm, float eps,
                        const struct layer_step *S, ELEM *hidden, ELEM *const *key_caches,
                        ELEM *const *value_caches, ELEM *workspace) {
    for (int64_t r = 0; r < S->tokens; ++r)
        if (S->positions[r] < 0 || S->positions[r] >= S->max_position) return LLAMA_BAD_POSITION;
    for (int64_t i = 0; i < count; ++i) {
        const int status = TYPED(llama_layer)(layers + i, S, hidden, key_caches[i], value_caches[i], workspace);
        if (status != 0) return status;
    }
    const int64_t h = layers[0].hidden;
    FOR_EACH_ROW(S->tokens, r, TYPED(rms_norm_row)(hidden + r * h, norm, hidden + r * h, h, eps););
    return 0;
}
