"""The HPU attention backend: a mixed step attended in regions whose shapes come from buckets.

On Gaudi, every distinct (ops, shapes) of a captured region or a lazy-mode graph is compiled
once, so a step may only show the device shapes that warm-up already showed it. The metadata
(vllm/attention/backends/hpu_metadata.py) is padded to buckets, and attention runs as two
captured regions, each keyed by two bucket sizes, so the graph counts add up instead of
multiplying:

    body (the model between attention calls)   key T           captured by the platform
    prefill part  PrefillAttention              key (T, C)      mask built inside from ids
    decode part   DecodeAttention               key (T, NB)     flat PA, mapping built inside
    combine (mixed steps only)                  key T

Each region is captured by the platform (`Platform.capture_region`: an HPU graph in lazy mode,
`hpu_backend` in compile mode) and separated from its neighbours by `mark_step`, which ends a
lazy-mode graph and does nothing in compile mode. Nothing inside reads a value back to the host
or makes a shape depend on data. Habana's fused SDPA kernel is used where the stack has it.
"""

import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from vllm.attention.backends.abstract import AttentionBackend, StepBatch
from vllm.attention.backends.hpu_metadata import (HpuAttentionMetadata, HpuBuckets, HpuDecodeMetadata,
                                                  HpuPrefillMetadata, build_decode, build_hpu_metadata,
                                                  build_prefill)
from vllm.config import EngineConfig
from vllm.worker.bucketing import pad_to_bucket

Sdpa = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def torch_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
               scale: float) -> torch.Tensor:
    """q: (1, KVH, R, D), k/v: (1, KVH, K, D), bias: (1, 1, R, K) additive -> (1, KVH, R, D)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


class PrefillAttention(nn.Module):
    """Every row of the step against [its sequence's cached context | the step's fresh keys].

    Rows that belong to no prefill chunk (decodes, padding) attend to their own key only and are
    zeroed on the way out; the decode part fills the decode rows.
    """

    def __init__(self, heads_per_kv: int, sliding_window: int | None, sdpa: Sdpa) -> None:
        super().__init__()
        self.heads_per_kv = heads_per_kv
        self.sliding_window = sliding_window
        self.sdpa = sdpa

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor,
                context_blocks: torch.Tensor | None, context_owner: torch.Tensor | None,
                context_usage: torch.Tensor | None, context_start: torch.Tensor | None,
                scale: float) -> torch.Tensor:
        t, h, d = query.shape
        kvh, r = key.shape[1], self.heads_per_kv
        window = self.sliding_window
        same_seq = (seq_ids[:, None] == seq_ids[None, :]) & (seq_ids[:, None] >= 0)     # (T, T)
        visible = same_seq & (positions[None, :] <= positions[:, None])
        if window is not None:
            visible &= positions[:, None] - positions[None, :] < window
        visible |= torch.eye(t, dtype=torch.bool, device=query.device)  # no empty row
        keys, values = key, value                                                     # (T, KVH, D)
        if context_blocks is not None:
            block_size = key_cache.shape[1]
            c = context_blocks.shape[0]
            ctx_k = key_cache.index_select(0, context_blocks).view(c * block_size, kvh, d)  # (C*bs, KVH, D)
            ctx_v = value_cache.index_select(0, context_blocks).view(c * block_size, kvh, d)
            offsets = torch.arange(block_size, device=query.device).repeat(c)           # (C*bs,)
            owner = context_owner.repeat_interleave(block_size)                         # (C*bs,)
            in_block = offsets < context_usage.repeat_interleave(block_size)
            ctx_visible = (owner[None, :] == seq_ids[:, None]) & in_block[None, :]     # (T, C*bs)
            if window is not None:
                key_pos = context_start.repeat_interleave(block_size) + offsets
                ctx_visible &= positions[:, None] - key_pos[None, :] < window
            visible = torch.cat([ctx_visible, visible], dim=1)                          # (T, K)
            keys, values = torch.cat([ctx_k, key]), torch.cat([ctx_v, value])          # (K, KVH, D)
        # Fold the r query heads of each KV head into rows: (1, KVH, r * T, D), row g * T + i.
        q = query.view(t, kvh, r, d).permute(1, 2, 0, 3).reshape(1, kvh, r * t, d)
        k = keys.transpose(0, 1).unsqueeze(0)                                           # (1, KVH, K, D)
        v = values.transpose(0, 1).unsqueeze(0)
        bias = torch.zeros(visible.shape, dtype=query.dtype, device=query.device)
        bias = bias.masked_fill(~visible, -math.inf).repeat(r, 1)[None, None]          # (1, 1, r*T, K)
        out = self.sdpa(q, k, v, bias, scale)                                           # (1, KVH, r*T, D)
        out = out.view(kvh, r, t, d).permute(2, 0, 1, 3).reshape(t, h, d)               # (T, H, D)
        return out * (seq_ids >= 0).to(out.dtype)[:, None, None]


class DecodeAttention(nn.Module):
    """Flat paged attention: one row of scores per cached block, reduced per decode.

    block_mapping (NB, T) is the one-hot of each block's token row; it copies each decode's query
    to its blocks and sums the blocks' partial results back, as two matmuls. Scores are shifted by
    the maximum over the decode's blocks, so exp never overflows and every real row sums to >= 1.
    Rows with no block (prefill tokens, padding) come out zero.
    """

    def __init__(self, heads_per_kv: int, sliding_window: int | None) -> None:
        super().__init__()
        self.heads_per_kv = heads_per_kv
        self.sliding_window = sliding_window

    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                positions: torch.Tensor, block_list: torch.Tensor, block_rows: torch.Tensor,
                block_usage: torch.Tensor, block_start: torch.Tensor, scale: float) -> torch.Tensor:
        t, h, d = query.shape
        nb, kvh, r = block_list.shape[0], key_cache.shape[2], self.heads_per_kv
        block_size = key_cache.shape[1]
        rows = torch.arange(t, device=query.device)
        mapping = (block_rows[:, None] == rows[None, :]).to(query.dtype)                # (NB, T)
        q = (mapping @ query.reshape(t, h * d)).view(nb, kvh, r, d)                     # (NB, KVH, r, D)
        k = key_cache.index_select(0, block_list).permute(0, 2, 3, 1)                   # (NB, KVH, D, bs)
        v = value_cache.index_select(0, block_list).transpose(1, 2)                     # (NB, KVH, bs, D)
        scores = (q @ k).float() * scale                                                # (NB, KVH, r, bs)
        offsets = torch.arange(block_size, device=query.device)
        valid = offsets[None, :] < block_usage[:, None]                                 # (NB, bs)
        if self.sliding_window is not None:
            query_pos = torch.cat([positions, positions.new_zeros(1)]).index_select(0, block_rows)  # (NB,)
            key_pos = block_start[:, None] + offsets[None, :]
            valid &= key_pos > query_pos[:, None] - self.sliding_window
        scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
        block_max = scores.amax(dim=-1)                                                 # (NB, KVH, r)
        seq_max = torch.full((t + 1, kvh, r), -math.inf, device=query.device)
        index = block_rows[:, None, None].expand_as(block_max)
        seq_max = seq_max.scatter_reduce(0, index, block_max, "amax")                    # (T + 1, KVH, r)
        weights = torch.exp(scores - seq_max.index_select(0, block_rows)[..., None])    # (NB, KVH, r, bs)
        sums = weights.sum(dim=-1)                                                      # (NB, KVH, r)
        partial = weights.to(v.dtype) @ v                                               # (NB, KVH, r, D)
        num = mapping.t() @ partial.reshape(nb, h * d)                                  # (T, H * D)
        den = mapping.float().t() @ sums.reshape(nb, h)                                 # (T, H)
        out = num.float().view(t, h, d) / den.clamp_min(1e-30)[..., None]
        return out.to(query.dtype)


class HpuAttentionBackend(AttentionBackend):
    """Shape-static attention for Gaudi (see the module doc)."""

    def __init__(self, config: EngineConfig, sliding_window: int | None, device: torch.device,
                 platform) -> None:
        super().__init__(config, sliding_window, device)
        self.platform = platform
        self.buckets = HpuBuckets.from_config(config)
        sdpa = platform.fused_sdpa() or torch_sdpa
        self.prefill_region = platform.capture_region(
            "prefill_attention", PrefillAttention(self.heads_per_kv, sliding_window, sdpa))
        self.decode_region = platform.capture_region(
            "decode_attention", DecodeAttention(self.heads_per_kv, sliding_window))

    def prepare_model(self, model: torch.nn.Module) -> None:
        rms_norm = self.platform.fused_rms_norm()
        if rms_norm is not None:
            for module in model.modules():
                if hasattr(module, "fused_kernel"):
                    module.fused_kernel = rms_norm

    def padded_rows(self, n: int, num_tokens: int) -> int:
        return pad_to_bucket(self.buckets.rows_for(num_tokens), n)

    def row_buckets(self, num_tokens: int) -> list[int]:
        return self.buckets.rows_for(num_tokens)

    def padded_copies(self, n: int) -> int:
        assert n <= self.buckets.max_num_seqs, "a step forks at most one block per sequence"
        return self.buckets.max_num_seqs

    def copy_buckets(self) -> list[int]:
        return [self.buckets.max_num_seqs]

    def build_metadata(self, batch: StepBatch) -> HpuAttentionMetadata:
        return build_hpu_metadata(batch, self.buckets, self.block_size, self.pad_block, self.sliding_window,
                                  self.device)

    def _padding_metadata(self, num_tokens: int, context: int | None, decode: int) -> HpuAttentionMetadata:
        """A mixed step of padding only, with `context` context blocks (None: none) and `decode`
        decode blocks."""
        positions = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        slots = torch.full((num_tokens,), self.pad_slot, dtype=torch.int64, device=self.device)
        prefill = build_prefill([], num_tokens, self.block_size, self.pad_block, self.sliding_window,
                                [] if context is None else context, self.device)
        decode_part = build_decode([], num_tokens, self.block_size, self.pad_block, self.sliding_window,
                                   decode, self.device)
        return HpuAttentionMetadata(slots, positions, prefill, decode_part)

    def warmup_metadata(self, num_tokens: int) -> Iterator[HpuAttentionMetadata]:
        """One mixed step: the model body, both parts and their combination at this size."""
        contexts, decodes = self.buckets.region_keys(num_tokens)
        yield self._padding_metadata(num_tokens, contexts[0], decodes[0])

    def warmup_regions(self, num_tokens: int, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        """Every other key of the two parts at this size, on random inputs: the prefill part at
        every context bucket, the decode part at every block bucket a step of this size reaches."""
        contexts, decodes = self.buckets.region_keys(num_tokens)
        query = torch.randn(num_tokens, self.num_heads, self.head_dim, dtype=self.dtype, device=self.device)
        # Two tensors: one passed twice would be captured as aliased inputs.
        key, value = (torch.randn(num_tokens, self.num_kv_heads, self.head_dim, dtype=self.dtype,
                                  device=self.device) for _ in range(2))
        scale = self.head_dim ** -0.5
        for context in contexts[1:]:
            m = self._padding_metadata(num_tokens, context, decodes[0])
            self._attend_prefill(query, key, value, key_cache, value_cache, m, scale)
        for decode in decodes[1:]:
            m = self._padding_metadata(num_tokens, contexts[0], decode)
            self._attend_decode(query, key_cache, value_cache, m, scale)

    def _attend_prefill(self, query, key, value, key_cache, value_cache, m: HpuAttentionMetadata,
                        scale: float) -> torch.Tensor:
        p: HpuPrefillMetadata = m.prefill
        out = self.prefill_region(query, key, value, key_cache, value_cache, m.positions, p.seq_ids,
                                  p.context_blocks, p.context_owner, p.context_usage, p.context_start, scale)
        self.platform.mark_step()
        return out

    def _attend_decode(self, query, key_cache, value_cache, m: HpuAttentionMetadata, scale: float) -> torch.Tensor:
        d: HpuDecodeMetadata = m.decode
        out = self.decode_region(query, key_cache, value_cache, m.positions, d.block_list, d.block_rows,
                                 d.block_usage, d.block_start, scale)
        self.platform.mark_step()
        return out

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: HpuAttentionMetadata,
                scale: float) -> torch.Tensor:
        # The regions are keyed by layout too: q/k/v arrive as views of the fused projection.
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        num_kv_heads, head_dim = key.shape[1:]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, key)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, value)
        self.platform.mark_step()
        out = None
        if metadata.prefill is not None:
            out = self._attend_prefill(query, key, value, key_cache, value_cache, metadata, scale)
        if metadata.decode is not None:
            decoded = self._attend_decode(query, key_cache, value_cache, metadata, scale)
            if out is None:
                out = decoded
            else:
                out = out + decoded  # each part is zero on the other's rows
                self.platform.mark_step()
        if out is None:  # a padding-only step
            out = torch.zeros_like(query)
        return out
