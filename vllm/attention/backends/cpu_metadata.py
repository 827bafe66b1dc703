"""The CPU backend's metadata of one step: which tokens attend to which cached keys, as tensors.

The runner describes each sequence of a step by a `SeqSpan` (where its tokens sit in the flat
token dimension, how many cached keys precede them, its block table);
`build_attention_metadata` turns the step's spans into an `AttentionMetadata` that every layer
reuses. Sequences are grouped so that the many one-token decodes are not padded to the length
of a prefill chunk (and decodes of very different lengths fall into separate groups, as do
prefill chunks of very different lengths; see `_bands`):

    flat tokens   [ d0 d1 d2 | p0 p0 p0 p0 p0 | p1 p1 ]      decodes first, then prefill chunks
    decode group  queries [3, 1]   keys: all cached, gathered by block   [3, blocks * block_size]
    prefill group queries [2, 5]   keys: the chunk itself (causal)       [2, 5]
                                        + earlier chunks from the cache  [2, ctx_blocks * block_size]

On CPU the C kernels take the place of the groups and read the cache in place: `PagedDecodes`
hands all decodes to vllm/csrc/cpu/cpu_paged_decode.c, and `PagedPrefills` all prefill
chunks to vllm/csrc/cpu/cpu_paged_prefill.c. How the groups are attended:
vllm/attention/backends/cpu_attn.py.

With both kernels, a query goes to the kernel of its position's role rather than of its span's
role in the step (`_by_role`): the prompt's positions to the prefill kernel, generated ones to
the decode kernel. Each kernel sums a query's keys in an order fixed by its own sequence, so a
position then gets the same bits in every step that computes it. By step role it would not:
a chunk boundary can leave a prompt's last token alone (a one-token span the scheduler runs as
a decode), and a preempted request computes its generated positions again in prefill chunks:

    span       p0..p4 done by an earlier chunk, then [p5 | g0 g1 g2] (p: prompt, g: generated)
    prefill    p5                     one query, context 5
    decode     g0, g1, g2             rows of their own, each over the keys up to its position
"""

from dataclasses import dataclass, replace

import torch

from vllm.attention.backends.abstract import SeqSpan


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended together, their queries padded to a common length Q."""

    gather_index: torch.Tensor   # (S, Q) int64: flat token of each query; padding -> 0
    scatter_index: torch.Tensor  # (S, Q) int64: same, but padding -> num_tokens (a scratch row)
    block_tables: torch.Tensor   # (S, B) int64: cached blocks to read; padding -> the pad block
    # Full mask over the gathered cache, (S, 1, Q * heads_per_kv, B * block_size) bool, True =
    # attend: decodes, and prefill chunks under a sliding window. None for split prefill groups.
    mask: torch.Tensor | None
    # Split prefill groups only: additive mask over the cached context, (S, 1, 1, B * block_size),
    # and which sequences have no context at all (their context term is dropped).
    context_bias: torch.Tensor | None = None
    no_context: torch.Tensor | None = None  # (S,) bool
    # True for the decode group: its queries are tokens 0..S-1 of the step, one per sequence, so
    # they are sliced from the step's queries and outputs rather than gathered and scattered.
    leading_decodes: bool = False
    # Split prefill group of one sequence (the usual case, max_num_partial_prefills=1): the
    # number of its cached keys. They are read exactly, so no mask is needed, and the query heads
    # stay unfolded (the flash kernel maps GQA heads itself): no mask to build and add, and no
    # folded copy of the queries.
    exact_context: int = 0

    def to(self, device: torch.device, dtype: torch.dtype) -> "AttentionGroup":
        """Moves the tensors to `device`; the additive bias also takes the compute dtype."""
        bias = None if self.context_bias is None else self.context_bias.to(device, dtype)
        mask = None if self.mask is None else self.mask.to(device)
        no_context = None if self.no_context is None else self.no_context.to(device)
        return AttentionGroup(self.gather_index.to(device), self.scatter_index.to(device),
                              self.block_tables.to(device), mask, bias, no_context,
                              self.leading_decodes, self.exact_context)


@dataclass(slots=True)
class PagedDecodes:
    """All the step's decodes, for the CPU kernel that reads the cache in place."""

    block_tables: torch.Tensor  # (S, B) int64; padding -> the pad block
    seq_lens: torch.Tensor      # (S,) int64: keys of each sequence, its new token included
    sliding_window: int | None
    rows: torch.Tensor | None = None  # (S,) int64: each decode's token in the step; None: 0..S-1


@dataclass(slots=True)
class PagedPrefills:
    """All the step's prefill chunks, for the CPU kernel that reads the cache in place."""

    block_tables: torch.Tensor   # (S, B) int64; padding -> the pad block
    token_offsets: torch.Tensor  # (S,) int64: first flat token of each chunk
    query_lens: torch.Tensor     # (S,) int64
    context_lens: torch.Tensor   # (S,) int64: keys cached before the chunk
    sliding_window: int | None


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention inputs, shared by all layers."""

    slot_mapping: torch.Tensor          # (num_tokens,) int64: cache slot of each token's K/V
    groups: tuple[AttentionGroup, ...]  # decodes, then prefill chunks (empty groups omitted)
    num_real_tokens: int                # the sequences' tokens; bucket padding follows them
    paged_decodes: PagedDecodes | None = None    # set: the decodes are here, not in `groups`
    paged_prefills: PagedPrefills | None = None  # set: the prefill chunks are here, not in `groups`


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _indices(spans: list[SeqSpan], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    max_q = max(s.query_len for s in spans)
    offsets = torch.tensor([s.token_offset for s in spans])        # (S,)
    q_lens = torch.tensor([s.query_len for s in spans])            # (S,)
    q_idx = torch.arange(max_q)                                     # (Q,)
    valid_q = q_idx[None, :] < q_lens[:, None]                      # (S, Q)
    flat = offsets[:, None] + q_idx[None, :]                        # (S, Q)
    return torch.where(valid_q, flat, 0), torch.where(valid_q, flat, num_tokens), valid_q


def _block_tables(spans: list[SeqSpan], num_tokens_of, block_size: int, pad_block: int,
                  device: torch.device | None = None) -> torch.Tensor:
    counts = [_cdiv(num_tokens_of(s), block_size) for s in spans]
    width = max(max(counts), 1)
    # One tensor from lists: a tensor per row would cost more than the rest of the metadata.
    return torch.tensor([s.block_table[:n] + [pad_block] * (width - n) for s, n in zip(spans, counts)],
                        dtype=torch.int64, device=device)


def _masked_group(spans: list[SeqSpan], num_tokens: int, block_size: int, heads_per_kv: int,
                  sliding_window: int | None, pad_block: int,
                  leading_decodes: bool = False) -> AttentionGroup:
    """All keys from the cache, one boolean mask (decodes; prefills under a sliding window)."""
    gather_index, scatter_index, valid_q = _indices(spans, num_tokens)
    tables = _block_tables(spans, lambda s: s.context_len + s.query_len, block_size, pad_block)
    ctx_lens = torch.tensor([s.context_len for s in spans])        # (S,)
    q_pos = ctx_lens[:, None] + torch.arange(valid_q.shape[1])[None, :]  # (S, Q)
    k_pos = torch.arange(tables.shape[1] * block_size)              # (K,)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]                # (S, Q, K)
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    mask &= valid_q[:, :, None]
    # A padding query attends to key 0 only, so its softmax has no empty row (no NaN).
    mask[:, :, 0] |= ~valid_q
    # Query q of KV head h becomes rows q * heads_per_kv .. + heads_per_kv - 1 of that head.
    mask = mask.repeat_interleave(heads_per_kv, dim=1).unsqueeze(1)  # (S, 1, Q * r, K)
    return AttentionGroup(gather_index, scatter_index, tables, mask, leading_decodes=leading_decodes)


def _split_prefill_group(spans: list[SeqSpan], num_tokens: int, block_size: int,
                         pad_block: int) -> AttentionGroup:
    """Chunk-causal part on the fresh keys, plus the cached context if any (see module doc)."""
    gather_index, scatter_index, _ = _indices(spans, num_tokens)
    if all(s.context_len == 0 for s in spans):
        return AttentionGroup(gather_index, scatter_index, torch.empty(len(spans), 0, dtype=torch.int64),
                              mask=None)
    tables = _block_tables(spans, lambda s: s.context_len, block_size, pad_block)
    if len(spans) == 1:
        return AttentionGroup(gather_index, scatter_index, tables, mask=None,
                              exact_context=spans[0].context_len)
    ctx_lens = torch.tensor([s.context_len for s in spans])        # (S,)
    k_pos = torch.arange(tables.shape[1] * block_size)              # (K,)
    visible = k_pos[None, :] < ctx_lens[:, None]                    # (S, K)
    no_context = ctx_lens == 0
    visible[:, 0] |= no_context  # keeps the softmax finite; the term is dropped at the merge
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    return AttentionGroup(gather_index, scatter_index, tables, mask=None,
                          context_bias=bias[:, None, None, :], no_context=no_context)


def _bands(spans: list[SeqSpan], size) -> list[list[SeqSpan]]:
    """Splits `spans` into groups in which no member's `size(span)` is below half its group's largest.

    A group is padded to its largest member (keys for decodes, queries for prefill chunks), so
    one 2000-token sequence among short ones would make every short one attend at its size.
    Sorted by size, a new group starts wherever a member is under half its group's largest.
    Each group keeps the step's token order.
    """
    order = sorted(spans, key=size, reverse=True)
    bands: list[list[SeqSpan]] = []
    for span in order:
        if not bands or 2 * size(span) < size(bands[-1][0]):
            bands.append([])
        bands[-1].append(span)
    return [sorted(band, key=lambda s: s.token_offset) for band in bands]


def _by_role(spans: list[SeqSpan]) -> tuple[list[SeqSpan], list[SeqSpan]]:
    """(decodes, prefill chunks) of the step's spans by the role of each query's position: a
    one-query span per generated position, and per sequence one chunk of its prompt positions."""
    decodes: list[SeqSpan] = []
    prefills: list[SeqSpan] = []
    for span in spans:
        assert span.num_prompt_tokens is not None
        prompt = span.num_prompt_tokens - span.context_len  # of the span's positions
        if prompt <= 0 and span.query_len == 1:  # a decode
            decodes.append(span)
            continue
        if prompt >= span.query_len:  # a prompt chunk, or a prompt's last token alone
            prefills.append(span)
            continue
        if prompt > 0:
            prefills.append(replace(span, query_len=prompt))
        decodes.extend(replace(span, token_offset=span.token_offset + i, query_len=1, context_len=span.context_len + i)
                       for i in range(max(prompt, 0), span.query_len))
    return decodes, prefills


def build_attention_metadata(spans: list[SeqSpan], num_decodes: int, slot_mapping: list[int],
                             block_size: int, heads_per_kv: int, sliding_window: int | None,
                             pad_block: int, device: torch.device,
                             dtype: torch.dtype = torch.float32,
                             split_prefill: bool = True,
                             paged_decode: bool = False,
                             paged_prefill: bool = False) -> AttentionMetadata:
    """Builds the metadata of one step; `spans[:num_decodes]` are the one-token decodes.

    `split_prefill` selects the chunk-causal + context split for prefill chunks (CPU kernels);
    otherwise, and always under a sliding window, prefills use one explicit mask.
    `paged_decode` hands all decodes to the CPU kernel (vllm/attention/ops/cpu_paged_decode.py),
    `paged_prefill` all prefill chunks to vllm/attention/ops/cpu_paged_prefill.py; with both, and
    spans that give their prompt's length, each query goes to the kernel of its position's role
    (see the module doc).
    """
    num_tokens = len(slot_mapping)
    groups = []
    decodes, prefills = spans[:num_decodes], spans[num_decodes:]
    assert all(s.query_len == 1 and s.token_offset == i for i, s in enumerate(decodes))
    if paged_decode and paged_prefill and all(s.num_prompt_tokens is not None for s in spans):
        decodes, prefills = _by_role(spans)
    paged = None
    if paged_decode and decodes:
        leading = all(s.token_offset == i for i, s in enumerate(decodes))
        paged = PagedDecodes(
            _block_tables(decodes, lambda s: s.context_len + 1, block_size, pad_block, device),
            torch.tensor([s.context_len + 1 for s in decodes], dtype=torch.int64, device=device),
            sliding_window,
            None if leading else torch.tensor([s.token_offset for s in decodes], dtype=torch.int64, device=device))
        decodes = []
    paged_prefills = None
    if paged_prefill and prefills:
        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)
        paged_prefills = PagedPrefills(
            _block_tables(prefills, lambda s: s.context_len + s.query_len, block_size, pad_block, device),
            column([s.token_offset for s in prefills]), column([s.query_len for s in prefills]),
            column([s.context_len for s in prefills]), sliding_window)
        prefills = []
    bands = _bands(decodes, lambda s: _cdiv(s.context_len + 1, block_size))  # keys, in blocks
    for band in bands:
        groups.append(_masked_group(band, num_tokens, block_size, heads_per_kv, sliding_window,
                                    pad_block, leading_decodes=len(bands) == 1))
    for band in _bands(prefills, lambda s: s.query_len):
        if split_prefill and sliding_window is None:
            groups.append(_split_prefill_group(band, num_tokens, block_size, pad_block))
        else:
            groups.append(_masked_group(band, num_tokens, block_size, heads_per_kv, sliding_window,
                                        pad_block))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        groups=tuple(g.to(device, dtype) for g in groups),
        num_real_tokens=max((s.token_offset + s.query_len for s in spans), default=0),
        paged_decodes=paged,
        paged_prefills=paged_prefills,
    )
