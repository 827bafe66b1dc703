"""Paged attention for a mixed step: prefill chunks and decodes in one flattened token dimension.

Every token of the step first writes its key/value into the paged cache (through
`slot_mapping`); then each sequence reads back all its keys, the earlier chunks' and its own, by
gathering whole blocks through its block table. Sequences are attended in two groups, so the
many one-token decodes are not padded to the length of a prefill chunk:

    flat tokens   [ d0 d1 d2 | p0 p0 p0 p0 p0 | p1 p1 ]      decodes first, then prefill chunks
    decode group  queries [3, 1]      keys [3, blocks_d * block_size]
    prefill group queries [2, 5]      keys [2, blocks_p * block_size]   (p1 padded to 5 queries)

A boolean mask gives query i of a sequence with `context_len` cached tokens the keys at
positions <= context_len + i (and inside the sliding window, if any). Grouped-query attention
folds the query heads that share a KV head into the query axis, so K/V are never repeated.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended together, their queries padded to a common length Q."""

    gather_index: torch.Tensor   # (S, Q) int64: flat token of each query; padding -> 0
    scatter_index: torch.Tensor  # (S, Q) int64: same, but padding -> num_tokens (a scratch row)
    block_tables: torch.Tensor   # (S, B) int64: padding -> the pad block
    mask: torch.Tensor           # (S, 1, Q * heads_per_kv, B * block_size) bool, True = attend

    @property
    def num_seqs(self) -> int:
        return self.gather_index.shape[0]

    @property
    def max_query_len(self) -> int:
        return self.gather_index.shape[1]


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention inputs, shared by all layers."""

    slot_mapping: torch.Tensor          # (num_tokens,) int64: cache slot of each token's K/V
    groups: tuple[AttentionGroup, ...]  # decodes, then prefill chunks (empty groups omitted)
    num_tokens: int


@dataclass(frozen=True, slots=True)
class SeqSpan:
    """Where one sequence's tokens sit in the step: flat offset, query length, cached context."""

    token_offset: int
    query_len: int
    context_len: int
    block_table: list[int]


def _build_group(spans: list[SeqSpan], num_tokens: int, block_size: int, heads_per_kv: int,
                 sliding_window: int | None, pad_block: int) -> AttentionGroup:
    num_seqs = len(spans)
    max_q = max(s.query_len for s in spans)
    max_blocks = max(-(-(s.context_len + s.query_len) // block_size) for s in spans)

    offsets = torch.tensor([s.token_offset for s in spans])        # (S,)
    q_lens = torch.tensor([s.query_len for s in spans])            # (S,)
    ctx_lens = torch.tensor([s.context_len for s in spans])        # (S,)
    tables = torch.full((num_seqs, max_blocks), pad_block, dtype=torch.int64)
    for i, s in enumerate(spans):
        n = -(-(s.context_len + s.query_len) // block_size)
        tables[i, :n] = torch.tensor(s.block_table[:n])

    q_idx = torch.arange(max_q)                                     # (Q,)
    valid_q = q_idx[None, :] < q_lens[:, None]                      # (S, Q)
    flat = offsets[:, None] + q_idx[None, :]                        # (S, Q)
    gather_index = torch.where(valid_q, flat, 0)
    scatter_index = torch.where(valid_q, flat, num_tokens)

    q_pos = ctx_lens[:, None] + q_idx[None, :]                      # (S, Q)
    k_pos = torch.arange(max_blocks * block_size)                   # (K,)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]                # (S, Q, K)
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    mask &= valid_q[:, :, None]
    # A padding query attends to key 0 only, so its softmax has no empty row (no NaN).
    mask[:, :, 0] |= ~valid_q
    # Query q of KV head h becomes rows q * heads_per_kv .. + heads_per_kv - 1 of that head.
    mask = mask.repeat_interleave(heads_per_kv, dim=1).unsqueeze(1)  # (S, 1, Q * r, K)
    return AttentionGroup(gather_index, scatter_index, tables, mask)


def build_attention_metadata(spans: list[SeqSpan], num_decodes: int, slot_mapping: list[int],
                             block_size: int, heads_per_kv: int, sliding_window: int | None,
                             pad_block: int, device: torch.device) -> AttentionMetadata:
    """Builds the metadata of one step; `spans[:num_decodes]` are the one-token decodes."""
    num_tokens = len(slot_mapping)
    groups = []
    for members in (spans[:num_decodes], spans[num_decodes:]):
        if members:
            g = _build_group(members, num_tokens, block_size, heads_per_kv, sliding_window, pad_block)
            groups.append(AttentionGroup(*(t.to(device) for t in (
                g.gather_index, g.scatter_index, g.block_tables, g.mask))))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        groups=tuple(groups),
        num_tokens=num_tokens,
    )


def write_to_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value: (T, KVH, D); caches: (num_blocks, block_size, KVH, D); slot_mapping: (T,)."""
    num_kv_heads, head_dim = key.shape[1:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of every query token over its own sequence's cached keys.

    query: (T, H, D); caches: (num_blocks, block_size, KVH, D), already holding this step's K/V.
    Returns (T, H, D).
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1:3]
    r = num_heads // num_kv_heads
    # One scratch row at the end receives the outputs of padding queries.
    out = query.new_empty(num_tokens + 1, num_heads, head_dim)      # (T + 1, H, D)
    for g in metadata.groups:
        s, q_len = g.gather_index.shape
        k_len = g.block_tables.shape[1] * block_size
        q = query[g.gather_index]                                    # (S, Q, H, D)
        q = q.view(s, q_len, num_kv_heads, r, head_dim).transpose(1, 2)
        q = q.reshape(s, num_kv_heads, q_len * r, head_dim)          # (S, KVH, Q * r, D)
        k = key_cache[g.block_tables].view(s, k_len, num_kv_heads, head_dim).transpose(1, 2)
        v = value_cache[g.block_tables].view(s, k_len, num_kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale)  # (S, KVH, Q*r, D)
        o = o.view(s, num_kv_heads, q_len, r, head_dim).transpose(1, 2)
        out[g.scatter_index.view(-1)] = o.reshape(s * q_len, num_heads, head_dim)
    return out[:num_tokens]
