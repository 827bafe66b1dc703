"""The CPU attention backend: paged attention for a mixed step of prefill chunks and decodes.

Every token of the step first writes its key/value into the paged cache (through
`slot_mapping`). Where the C kernels build, they read the cache in place: all decodes go to
vllm/csrc/cpu/cpu_paged_decode.c, and all prefill chunks (context and own keys in one pass)
to vllm/csrc/cpu/cpu_paged_prefill.c. Elsewhere the step's sequences are attended in the
groups of its metadata (vllm/attention/backends/cpu_metadata.py), one vectorized call per group:
a prefill chunk attends to its own tokens causally (no cache read, no mask) and, if earlier
chunks exist, to their cached keys without a causal mask (all of them precede the chunk); the
two partial softmaxes are merged through their log-sum-exp. With a sliding window the prefill
group uses one explicit mask over the gathered cache instead. Grouped-query attention folds the
query heads that share a KV head into the query axis wherever no causal structure is needed, so
K/V are not repeated there. Where the CPU has no bf16 dot products, bf16 groups compute in
float32 and round once (`_group_dtype`).

Shapes are exact: a captured CPU graph treats attention as an opaque op and its token count as
symbolic, so nothing here needs padding beyond the runner's token bucket.
"""

import torch
import torch.nn.functional as F

from vllm.attention.backends.abstract import AttentionBackend, StepBatch
from vllm.attention.backends.cpu_metadata import AttentionGroup, AttentionMetadata, build_attention_metadata
from vllm.attention.backends.cpu_metadata_checks import check_metadata
from vllm.attention.ops import cpu_kv_cache, cpu_paged_decode, cpu_paged_prefill
from vllm.config import EngineConfig
from vllm.model_executor.layers.linear import can_pack, pack_linear_weights
from vllm.platforms.cpu import cpu_has_native_bf16_dot


def write_to_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value: (T, KVH, D); caches: (num_blocks, block_size, KVH, D); slot_mapping: (T,).
    On CPU a C copy per token row (cpu_kv_cache.py); elsewhere two index_copy_ calls."""
    if cpu_kv_cache.write_rows(key, value, key_cache, value_cache, slot_mapping):
        return
    num_kv_heads, head_dim = key.shape[1:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def _fold(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(S, Q, H, D) -> (S, KVH, Q * r, D): the r query heads of a KV head become query rows."""
    s, q_len, h, d = q.shape
    r = h // num_kv_heads
    return q.view(s, q_len, num_kv_heads, r, d).transpose(1, 2).reshape(s, num_kv_heads, q_len * r, d)


def _unfold(o: torch.Tensor, q_len: int) -> torch.Tensor:
    """(S, KVH, Q * r, D) -> (S, Q, H, D)."""
    s, kvh, qr, d = o.shape
    return o.view(s, kvh, q_len, qr // q_len, d).transpose(1, 2).reshape(s, q_len, -1, d)


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x: (T, ...) and index (S, Q) -> (S, Q, ...)."""
    return x.index_select(0, index.view(-1)).view(*index.shape, *x.shape[1:])


def _gather_cache(cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache (num_blocks, block_size, KVH, D), tables (S, B) -> (S, KVH, B * block_size, D) in dtype."""
    s, b = block_tables.shape
    block_size, kvh, d = cache.shape[1:]
    # index_select copies whole blocks as contiguous runs; advanced indexing goes element by element.
    blocks = cache.index_select(0, block_tables.view(-1)).to(dtype)           # (S * B, bs, KVH, D)
    return blocks.view(s, b * block_size, kvh, d).transpose(1, 2)


def _group_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the torch groups compute in for a model in `dtype`. Without bf16 dot products,
    torch's bf16 attention converts its operands to float32 as it goes, below the float32 rate,
    and rounds each partial output to bf16 before they merge: there bf16 groups run in float32,
    rounded to bf16 once, so a chunk after cached context differs from the same tokens computed
    in one pass by float32 rounding only."""
    return torch.float32 if dtype == torch.bfloat16 and not cpu_has_native_bf16_dot() else dtype


def _masked_attention(g: AttentionGroup, query: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """query in the group's dtype (`_group_dtype`). Returns (S, Q, H, D) in that dtype."""
    q_len = g.gather_index.shape[1]
    if g.leading_decodes:
        s = g.gather_index.shape[0]
        q = _fold(query[:s].unsqueeze(1), key_cache.shape[2])         # (S, KVH, r, D)
    else:
        q = _fold(_rows(query, g.gather_index), key_cache.shape[2])  # (S, KVH, Q * r, D)
    k = _gather_cache(key_cache, g.block_tables, query.dtype)         # (S, KVH, K, D)
    v = _gather_cache(value_cache, g.block_tables, query.dtype)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale)
    return _unfold(o, q_len)


def _split_prefill_attention(g: AttentionGroup, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """query, key and value in the group's dtype (`_group_dtype`). Returns (S, Q, H, D) in that
    dtype."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    q_rows = _rows(query, g.gather_index)                             # (S, Q, H, D)
    q = q_rows.transpose(1, 2)                                        # (S, H, Q, D)
    # The CPU flash kernel maps query head h to KV head h // r itself, without copies.
    k = _rows(key, g.gather_index).transpose(1, 2)                    # (S, KVH, Q, D)
    v = _rows(value, g.gather_index).transpose(1, 2)
    o_chunk, lse_chunk = flash(q, k, v, 0.0, True, scale=scale)     # (S, H, Q, D), (S, H, Q)
    if g.context_bias is None and not g.exact_context:
        return o_chunk.transpose(1, 2)
    kc = _gather_cache(key_cache, g.block_tables, query.dtype)       # (S, KVH, K, D)
    vc = _gather_cache(value_cache, g.block_tables, query.dtype)
    if g.exact_context:
        kc, vc = kc[:, :, :g.exact_context], vc[:, :, :g.exact_context]  # (1, KVH, C, D)
        o_ctx, lse_ctx = flash(q, kc, vc, 0.0, False, scale=scale)   # (1, H, Q, D), (1, H, Q)
    else:
        q_len = q_rows.shape[1]
        o_ctx, lse_ctx = flash(_fold(q_rows, key.shape[1]), kc, vc, 0.0, False,
                               attn_mask=g.context_bias, scale=scale)  # (S, KVH, Q*r, D), (S, KVH, Q*r)
        o_ctx = _unfold(o_ctx, q_len).transpose(1, 2)                # (S, H, Q, D)
        s, kvh, _ = lse_ctx.shape
        r = query.shape[1] // kvh
        lse_ctx = lse_ctx.view(s, kvh, q_len, r).transpose(2, 3).reshape(s, kvh * r, q_len)  # (S, H, Q)
        lse_ctx = lse_ctx.masked_fill(g.no_context[:, None, None], float("-inf"))
    # Softmax over both key sets = the two partial softmaxes weighted by their total mass:
    # w_chunk = e^lse_chunk / (e^lse_chunk + e^lse_ctx) = sigmoid(lse_chunk - lse_ctx), and
    # w_ctx = 1 - w_chunk. One lerp is one pass over the outputs, where the weighted sum of two
    # products is three.
    w_chunk = torch.sigmoid(lse_chunk - lse_ctx).unsqueeze(-1)       # (S, H, Q, 1) fp32
    o = torch.lerp(o_ctx.float(), o_chunk.float(), w_chunk).to(query.dtype)
    return o.transpose(1, 2)                                          # (S, Q, H, D)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of every query token over its own sequence's keys.

    query: (T, H, D); key/value: (T, KVH, D), this step's, already written to the caches
    (num_blocks, block_size, KVH, D). Returns (T, H, D); rows of tokens in no group are zero.
    """
    num_tokens, num_heads, head_dim = query.shape
    # One scratch row at the end receives the outputs of padding queries. Rows of tokens in no
    # group (bucket padding) must be zero, to stay finite: their K/V reach the cache. Where the
    # kernels take every sequence (no groups), they write all rows before the padding.
    if metadata.groups:
        out = query.new_zeros(num_tokens + 1, num_heads, head_dim)  # (T + 1, H, D)
    else:
        out = query.new_empty(num_tokens + 1, num_heads, head_dim)
        out[metadata.num_real_tokens:].zero_()
    paged = metadata.paged_decodes
    if paged is not None:
        s = paged.seq_lens.shape[0]
        if paged.rows is None:  # the leading tokens
            cpu_paged_decode.paged_decode(query[:s].contiguous(), key_cache, value_cache, paged.block_tables,
                                          paged.seq_lens, scale, paged.sliding_window, out[:s])
        else:
            o = query.new_empty(s, num_heads, head_dim)                                # (S, H, D)
            cpu_paged_decode.paged_decode(query.index_select(0, paged.rows), key_cache, value_cache,
                                          paged.block_tables, paged.seq_lens, scale, paged.sliding_window, o)
            out.index_copy_(0, paged.rows, o)
    prefills = metadata.paged_prefills
    if prefills is not None:
        cpu_paged_prefill.paged_prefill(query, key_cache, value_cache, prefills.block_tables,
                                        prefills.token_offsets, prefills.query_lens, prefills.context_lens,
                                        scale, prefills.sliding_window, out[:num_tokens])
    if metadata.groups:
        dtype = _group_dtype(query.dtype)
        q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)   # (T, H, D), (T, KVH, D) x 2
    for g in metadata.groups:
        if g.mask is not None:
            o = _masked_attention(g, q, key_cache, value_cache, scale).to(query.dtype)
        else:
            o = _split_prefill_attention(g, q, k, v, key_cache, value_cache, scale).to(query.dtype)
        if g.leading_decodes:
            out[:o.shape[0]] = o.view(-1, num_heads, head_dim)
        else:
            out.index_copy_(0, g.scatter_index.view(-1), o.reshape(-1, num_heads, head_dim))
    return out[:num_tokens]


class CpuAttentionBackend(AttentionBackend):
    """The C kernels where they build for the model's shapes and dtype, torch groups elsewhere.

    For bf16 it also prepares the model: linear weights packed for the C GEMV and tile GEMM, the
    element-wise C ops turned on, and, where the decode kernel builds, the decoder layers in C
    for the eager steps whose attention the kernels take whole. For float32, decode rows of the
    linear layers go to the C float32 GEMV, and steps of decodes to the decoder layers in C.
    """

    def __init__(self, config: EngineConfig, sliding_window: int | None, device: torch.device) -> None:
        super().__init__(config, sliding_window, device)
        shapes = (self.num_heads, self.num_kv_heads, self.head_dim)
        self.paged_decode = cpu_paged_decode.is_available(device, self.dtype, *shapes)
        self.paged_prefill = cpu_paged_prefill.is_available(device, self.dtype, *shapes, self.block_size)
        self.fused_layers = None  # llama_cpu_layers.FusedLayers, set by prepare_model

    def prepare_model(self, model: torch.nn.Module) -> None:
        if not can_pack(self.dtype):
            return
        pack_linear_weights(model)
        if self.dtype == torch.bfloat16:  # the element-wise C ops are bf16's
            for module in model.modules():
                if hasattr(module, "c_kernels"):
                    module.c_kernels = True
        # Steps of only decodes take the C layers in graph mode too (nothing for a graph to
        # remove); their metadata must then carry the decodes for the paged kernel.
        if self.paged_decode and hasattr(model, "enable_fused_layers"):
            self.fused_layers = model.enable_fused_layers()

    def runs_eagerly(self, num_decodes: int, num_tokens: int) -> bool:
        return self.fused_layers is not None and num_decodes == num_tokens <= self.fused_layers.max_tokens

    def build_metadata(self, batch: StepBatch) -> AttentionMetadata:
        metadata = build_attention_metadata(
            batch.spans, batch.num_decodes, batch.slot_mapping, self.block_size, self.heads_per_kv,
            self.sliding_window, self.pad_block, self.device, _group_dtype(self.dtype), split_prefill=True,
            paged_decode=self.paged_decode, paged_prefill=self.paged_prefill)
        check_metadata(metadata, self.pad_block + 1, self.block_size)  # the C kernels trust it
        return metadata

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        write_to_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        return paged_attention(query, key, value, key_cache, value_cache, metadata, scale)
