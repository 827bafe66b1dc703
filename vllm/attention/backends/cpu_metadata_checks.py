"""Bounds of the CPU backend's step metadata, checked once per step before the C kernels read it.

The C kernels index the paged cache with these tensors as they are (cpu_paged_decode.c,
cpu_paged_prefill.c, llama_cpu_layers.c): an entry past the cache is an out-of-bounds read or
write, not an error. One min/max per tensor of the step (a few microseconds) turns a bad value
into an IndexError that names it, before any layer runs.
"""

import torch

from vllm.attention.backends.cpu_metadata import AttentionMetadata


def _within(name: str, values: torch.Tensor, low: int, high: int) -> None:
    """Raises IndexError unless every value lies in [low, high)."""
    if values.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(values))
    if lo < low or hi >= high:
        raise IndexError(f"{name} {lo if lo < low else hi} outside [{low}, {high})")


def check_metadata(metadata: AttentionMetadata, num_cache_blocks: int, block_size: int) -> None:
    """`num_cache_blocks` counts the pad block, which padded table entries and slots may use."""
    num_tokens = metadata.slot_mapping.shape[0]
    _within("slot", metadata.slot_mapping, 0, num_cache_blocks * block_size)
    decodes = metadata.paged_decodes
    if decodes is not None:
        num_seqs, width = decodes.block_tables.shape
        if decodes.seq_lens.shape != (num_seqs,) or num_seqs > num_tokens:
            raise IndexError(f"{num_seqs} decode block tables, {tuple(decodes.seq_lens.shape)} "
                             f"sequence lengths, {num_tokens} tokens")
        if decodes.rows is not None:
            if decodes.rows.shape != (num_seqs,):
                raise IndexError(f"{num_seqs} decode block tables, {tuple(decodes.rows.shape)} decode rows")
            _within("decode row", decodes.rows, 0, num_tokens)
        _within("decode block table entry", decodes.block_tables, 0, num_cache_blocks)
        # A length reads keys up to its last position: within its table of `width` blocks.
        _within("decode sequence length", decodes.seq_lens, 1, width * block_size + 1)
    for group in metadata.groups:  # read by torch ops, which check bounds too, but not all of them
        _within("block table entry", group.block_tables, 0, num_cache_blocks)
    prefills = metadata.paged_prefills
    if prefills is not None:
        num_seqs, width = prefills.block_tables.shape
        columns = (prefills.token_offsets, prefills.query_lens, prefills.context_lens)
        if any(c.shape != (num_seqs,) for c in columns):
            raise IndexError(f"{num_seqs} prefill block tables, columns of shapes "
                             f"{[tuple(c.shape) for c in columns]}")
        _within("prefill block table entry", prefills.block_tables, 0, num_cache_blocks)
        _within("prefill query length", prefills.query_lens, 1, num_tokens + 1)
        _within("prefill context length", prefills.context_lens, 0, width * block_size)
        _within("prefill keys (context + query)", prefills.context_lens + prefills.query_lens, 1,
                width * block_size + 1)
        _within("prefill token offset", prefills.token_offsets, 0, num_tokens)
        _within("prefill end (offset + query)", prefills.token_offsets + prefills.query_lens, 1,
                num_tokens + 1)
