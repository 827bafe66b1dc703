"""A plain attention over the paged cache, one sequence at a time: what the attention backends
are tested against. Each query reads its own positions' slots, gathered from the block table
position by position; a mask keeps it to its causal (and sliding) window."""

import torch

from vllm.attention.backends.abstract import SeqSpan
from vllm.core.block_manager import kv_slots


def reference_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              spans: list[SeqSpan], scale: float,
                              sliding_window: int | None = None) -> torch.Tensor:
    """query: (T, H, D); caches: (num_blocks, block_size, KVH, D). Returns (T, H, D) in float32."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    r = query.shape[1] // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float32)
    for span in spans:
        if span.query_len == 0:
            continue
        positions = torch.arange(span.context_len, span.context_len + span.query_len)      # (Q,)
        # The positions some query sees, from the first query's window on: each query masks
        # those outside its own.
        first = 0 if sliding_window is None else max(0, span.context_len - sliding_window + 1)
        key_positions = torch.arange(first, span.context_len + span.query_len)                  # (K,)
        slots = kv_slots(span.block_table, key_positions.tolist(), block_size)
        # Query head h reads KV head h // r.
        keys = key_cache.reshape(-1, num_kv_heads, head_dim)[slots].float().repeat_interleave(r, 1)  # (K, H, D)
        values = value_cache.reshape(-1, num_kv_heads, head_dim)[slots].float().repeat_interleave(r, 1)
        visible = key_positions[None, :] <= positions[:, None]                                  # (Q, K)
        if sliding_window is not None:
            visible &= key_positions[None, :] > positions[:, None] - sliding_window
        # Tests write NaN where no query may look: a NaN here would reach every query through the
        # masked product, so the reference refuses it rather than hide it.
        assert not keys.isnan().any() and not values.isnan().any(), "a key in some query's window is NaN"
        q = query[span.token_offset:span.token_offset + span.query_len].float()                # (Q, H, D)
        scores = torch.einsum("qhd,khd->qhk", q, keys) * scale                                  # (Q, H, K)
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out[span.token_offset:span.token_offset + span.query_len] = torch.einsum(
            "qhk,khd->qhd", torch.softmax(scores, dim=-1), values)                               # (Q, H, D)
    return out
