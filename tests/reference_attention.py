"""A deliberately naive attention over the paged cache, one query token at a time: what the
attention backends are tested against."""

import torch

from vllm.attention.backends.abstract import SeqSpan
from vllm.core.block_manager import kv_slots


def reference_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              spans: list[SeqSpan], scale: float,
                              sliding_window: int | None = None) -> torch.Tensor:
    """query: (T, H, D); caches: (num_blocks, block_size, KVH, D). Returns (T, H, D) in float32."""
    block_size, num_kv_heads = key_cache.shape[1:3]
    r = query.shape[1] // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float32)
    for span in spans:
        for i in range(span.query_len):
            pos = span.context_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            slots = kv_slots(span.block_table, range(lo, pos + 1), block_size)
            # Query head h reads KV head h // r.
            keys = key_cache.reshape(-1, num_kv_heads, key_cache.shape[-1])[slots].float().repeat_interleave(r, 1)
            values = value_cache.reshape(-1, num_kv_heads, value_cache.shape[-1])[slots].float().repeat_interleave(r, 1)
            q = query[span.token_offset + i].float()                              # (H, D)
            scores = torch.einsum("hd,khd->hk", q, keys) * scale                  # (H, keys)
            out[span.token_offset + i] = torch.einsum("hk,khd->hd", torch.softmax(scores, dim=1), values)
    return out
