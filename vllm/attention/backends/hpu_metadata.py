"""The HPU backend's metadata: every tensor of a step shaped by a bucket, nothing by the step.

A step of T tokens (the token bucket: decodes, then prefill chunks, then padding) is attended in
two parts, each a captured region keyed by two numbers:

    prefill part, key (T, C)   every row attends to [its sequence's cached context | the step's
                               fresh keys]; the context blocks of all chunks are gathered into one
                               list padded to C blocks, and the mask is built inside the region
                               from per-token sequence ids and positions
    decode part,  key (T, NB)  flat paged attention: the decodes' blocks in one list padded to NB
                               blocks, each block knowing the token row it serves (Habana's flat PA)

    tokens        [ d0 d1 | p0 p0 p0 | p1 p1 | pad pad pad ]      T = 10
    seq_ids       [ -1 -1 |  0  0  0 |  1  1 |  -1  -1  -1 ]      prefill sequence of each token
    context       [ b7 b2 (p0's) | b9 (p1's) | pad ... ]          C = 4, owners [0 0 1 -2]
    decode blocks [ b4 b5 (d0) | b1 (d1) | pad ... ]              NB = 4, rows  [0 0 1 T]

Padding is inert: padded context blocks belong to no sequence (owner -2), padded decode blocks
serve the scratch row T, which is dropped, and both point at the cache's pad block, which holds
finite values. Every real row has at least one key, so no softmax row is empty.

Bucket lists (`HpuBuckets`): the token buckets come from the runner; context blocks and decode
blocks grow exponentially from 1 up to what the configuration can reach, with 0 meaning "no
such part" (the region is then not run).
"""

from dataclasses import dataclass

import torch

from vllm.attention.backends.abstract import SeqSpan, StepBatch
from vllm.config import EngineConfig
from vllm.worker.bucketing import exponential_buckets, pad_to_bucket, reachable

NO_OWNER = -2  # owner of padded context blocks: matches no token's sequence id (-1 included)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Smallest context and decode block buckets: below them, padding costs the device less than the
# graphs another bucket would add.
MIN_CONTEXT_BLOCKS = 4
MIN_DECODE_BLOCKS = 16
BODY_PIECES = 3  # the model between attention calls: first layer, middle layers, last layer


@dataclass(frozen=True)
class HpuBuckets:
    """The sizes every per-step tensor of the HPU path is padded to.

    Rows of logits are taken for the sampled sequences (at most max_num_seqs, padded to that many:
    the lm_head's time is set by its weights, not by a few rows) or, when a step asks for prompt
    logprobs, for all T tokens. Block copies (forks) are padded to max_num_seqs.
    """

    context_blocks: list[int]  # C: cached context blocks of all prefill chunks of a step
    decode_blocks: list[int]   # NB: blocks read by all decodes of a step
    blocks_per_seq: int
    max_num_seqs: int

    @classmethod
    def from_limits(cls, block_size: int, max_model_len: int, max_num_seqs: int,
                    max_num_partial_prefills: int) -> "HpuBuckets":
        blocks_per_seq = _cdiv(max_model_len, block_size)
        # Not capped by the cache size: sequences may share blocks (the samples of one request),
        # and each lists its own.
        max_context, max_decode = max_num_partial_prefills * blocks_per_seq, max_num_seqs * blocks_per_seq
        return cls(context_blocks=exponential_buckets(min(MIN_CONTEXT_BLOCKS, max_context), max_context),
                   decode_blocks=exponential_buckets(min(MIN_DECODE_BLOCKS, max_decode), max_decode),
                   blocks_per_seq=blocks_per_seq, max_num_seqs=max_num_seqs)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "HpuBuckets":
        sched = config.scheduler
        return cls.from_limits(config.cache.block_size, sched.max_model_len, sched.max_num_seqs,
                               sched.max_num_partial_prefills)

    def region_keys(self, num_tokens: int) -> tuple[list[int | None], list[int]]:
        """The context sizes of the prefill part (None: no context) and the block counts of the
        decode part that a step of `num_tokens` tokens can show."""
        decodes = reachable(self.decode_blocks, min(num_tokens, self.max_num_seqs) * self.blocks_per_seq)
        return [None, *self.context_blocks], decodes

    def rows_for(self, num_tokens: int) -> list[int]:
        """Logits row counts of a step of `num_tokens` tokens: its sampled rows, or every token."""
        return sorted({min(num_tokens, self.max_num_seqs), num_tokens})

    def graph_counts(self, token_buckets: list[int]) -> dict[str, int]:
        """The graphs warm-up compiles, per region (see hpu_attn.py's module doc)."""
        counts = {"body": 0, "combine": 0, "prefill_attention": 0, "decode_attention": 0, "logits": 0,
                  "block_copies": 1}
        for t in token_buckets:
            contexts, decodes = self.region_keys(t)
            counts["body"] += BODY_PIECES
            counts["combine"] += 1
            counts["prefill_attention"] += len(contexts)
            counts["decode_attention"] += len(decodes)
            counts["logits"] += len(self.rows_for(t))
        return counts


@dataclass(slots=True)
class HpuPrefillMetadata:
    """The prefill part of a step (see the module doc)."""

    seq_ids: torch.Tensor         # (T,) int64: prefill sequence of each token; -1 elsewhere
    context_blocks: torch.Tensor | None  # (C,) int64 cache blocks; None when no chunk has context
    context_owner: torch.Tensor | None   # (C,) int64 prefill sequence of each block; NO_OWNER pads
    context_usage: torch.Tensor | None   # (C,) int64 context keys in the block (0 for padding)
    context_start: torch.Tensor | None   # (C,) int64 position of the block's first key


@dataclass(slots=True)
class HpuDecodeMetadata:
    """The decode part of a step: flat paged attention over one padded list of blocks."""

    block_list: torch.Tensor   # (NB,) int64 cache blocks; padding -> the pad block
    block_rows: torch.Tensor   # (NB,) int64 token row of the decode each block serves; padding -> T
    block_usage: torch.Tensor  # (NB,) int64 keys in the block (>= 1, padding 1: no empty block)
    block_start: torch.Tensor  # (NB,) int64 position of the block's first key


@dataclass(slots=True)
class HpuAttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64 cache slot of each token's K/V; padding -> the pad slot
    positions: torch.Tensor     # (T,) int64
    prefill: HpuPrefillMetadata | None  # None: the step has no prefill chunk
    decode: HpuDecodeMetadata | None    # None: the step has no decode


def _window_start(position: int, sliding_window: int | None) -> int:
    """First key position a query at `position` sees."""
    return 0 if sliding_window is None else max(0, position - sliding_window + 1)


def _column(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def build_prefill(chunks: list[SeqSpan], num_tokens: int, block_size: int, pad_block: int,
                  sliding_window: int | None, context_buckets: list[int] | int,
                  device: torch.device) -> HpuPrefillMetadata:
    """`context_buckets`: the list to pad the context to, or a fixed count (warm-up)."""
    seq_ids = [-1] * num_tokens
    blocks, owners, usage, starts = [], [], [], []
    for i, s in enumerate(chunks):
        seq_ids[s.token_offset:s.token_offset + s.query_len] = [i] * s.query_len
        # Context blocks before the chunk; those wholly before every chunk token's window are left out.
        first = _window_start(s.context_len, sliding_window) // block_size
        for b in range(first, _cdiv(s.context_len, block_size)):
            blocks.append(s.block_table[b])
            owners.append(i)
            usage.append(min(block_size, s.context_len - b * block_size))
            starts.append(b * block_size)
    if not blocks and not isinstance(context_buckets, int):
        return HpuPrefillMetadata(_column(seq_ids, device), None, None, None, None)
    size = context_buckets if isinstance(context_buckets, int) else pad_to_bucket(context_buckets, len(blocks))
    pad = size - len(blocks)
    return HpuPrefillMetadata(
        seq_ids=_column(seq_ids, device),
        context_blocks=_column(blocks + [pad_block] * pad, device),
        context_owner=_column(owners + [NO_OWNER] * pad, device),
        context_usage=_column(usage + [0] * pad, device),
        context_start=_column(starts + [0] * pad, device))


def build_decode(decodes: list[SeqSpan], num_tokens: int, block_size: int, pad_block: int,
                 sliding_window: int | None, decode_buckets: list[int] | int,
                 device: torch.device) -> HpuDecodeMetadata:
    """`decode_buckets`: the list to pad the block list to, or a fixed count (warm-up)."""
    blocks, rows, usage, starts = [], [], [], []
    for s in decodes:
        position = s.context_len  # the decode's own token, already in the cache
        for b in range(_window_start(position, sliding_window) // block_size, position // block_size + 1):
            blocks.append(s.block_table[b])
            rows.append(s.token_offset)
            usage.append(min(block_size, position + 1 - b * block_size))
            starts.append(b * block_size)
    size = decode_buckets if isinstance(decode_buckets, int) else pad_to_bucket(decode_buckets, len(blocks))
    pad = size - len(blocks)
    return HpuDecodeMetadata(
        block_list=_column(blocks + [pad_block] * pad, device),
        block_rows=_column(rows + [num_tokens] * pad, device),
        block_usage=_column(usage + [1] * pad, device),
        block_start=_column(starts + [0] * pad, device))


def build_hpu_metadata(batch: StepBatch, buckets: HpuBuckets, block_size: int, pad_block: int,
                       sliding_window: int | None, device: torch.device) -> HpuAttentionMetadata:
    decodes, chunks = batch.spans[:batch.num_decodes], batch.spans[batch.num_decodes:]
    assert all(s.query_len == 1 and s.token_offset == i for i, s in enumerate(decodes))
    n = batch.num_tokens
    return HpuAttentionMetadata(
        slot_mapping=_column(batch.slot_mapping, device),
        positions=_column(batch.positions, device),
        prefill=build_prefill(chunks, n, block_size, pad_block, sliding_window, buckets.context_blocks,
                              device) if chunks else None,
        decode=build_decode(decodes, n, block_size, pad_block, sliding_window, buckets.decode_blocks,
                            device) if decodes else None)
