"""Logits processors: grammar masks, allowed token ids, bad words, min_tokens masking, logit bias
and penalties before sampling, min_p inside it.

Each takes the float32 logits of the rows that sample, (R, V), and returns new (R, V) logits,
leaving its input alone. They run every decode step, so each returns its input untouched when
no row uses its feature.
"""

import torch

from vllm.sampling_params import SamplingParams


def apply_token_masks(logits: torch.Tensor, masks: list[torch.Tensor | None] | None) -> torch.Tensor:
    """Leaves each row with a mask only the tokens its mask allows: masks[i] is row i's packed
    bitmask, (ceil(V / 32),) int32 with bit j of word w for token 32 w + j (a structured output's
    grammar, vllm/engine/structured_output.py), or None."""
    if not masks or all(m is None for m in masks):
        return logits
    num_rows, vocab = logits.shape
    assert len(masks) == num_rows
    rows = [i for i, m in enumerate(masks) if m is not None]
    words = torch.stack([masks[i] for i in rows])                              # (M, W) int32
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1    # (M, W, 32)
    allowed = torch.ones(logits.shape, dtype=torch.bool)                       # (R, V)
    allowed[rows] = bits.flatten(1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))                         # (R, V)


def apply_allowed_token_ids(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Leaves a row with `allowed_token_ids` only those tokens (the engine checked the ids)."""
    assert logits.shape[0] == len(params)
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return logits
    banned = torch.zeros(logits.shape, dtype=torch.bool)                       # (R, V)
    banned[rows] = True
    allowed = [(i, t) for i in rows for t in params[i].allowed_token_ids]
    banned[tuple(torch.tensor(allowed).T)] = False
    return logits.masked_fill(banned, float("-inf"))                           # (R, V)


def apply_bad_words(logits: torch.Tensor, params: list[SamplingParams],
                    output_token_ids: list[list[int]]) -> torch.Tensor:
    """Forbids the token that would complete a bad word: a one-token word always, a longer one
    when the row's output ends with the word's other tokens (the prompt does not count)."""
    assert logits.shape[0] == len(params) == len(output_token_ids)
    rows, cols = [], []
    for i, (p, output) in enumerate(zip(params, output_token_ids)):
        for *head, last in p.bad_words_token_ids:
            if not head or (len(output) >= len(head) and output[-len(head):] == head):
                rows.append(i)
                cols.append(last)
    if not rows:
        return logits
    index = (torch.tensor(rows), torch.tensor(cols))                           # 2 x (M,)
    return logits.index_put(index, logits.new_tensor(float("-inf")))            # (R, V)


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Adds each row's `logit_bias` to the logits of its token ids."""
    assert logits.shape[0] == len(params)
    entries = [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()]
    if not entries:
        return logits
    rows, cols, biases = zip(*entries)
    index = (torch.tensor(rows), torch.tensor(cols))                           # 2 x (M,)
    return logits.index_put(index, torch.tensor(biases), accumulate=True)       # (R, V)


def apply_min_tokens(logits: torch.Tensor, params: list[SamplingParams],
                     num_output_tokens: list[int], eos_token_id: int | None) -> torch.Tensor:
    """Forbids EOS and the row's `stop_token_ids` while it has fewer than `min_tokens` outputs.

    EOS is masked even with `ignore_eos` (as in vLLM). Ids outside the vocabulary are skipped:
    they can never be sampled anyway.
    """
    assert logits.shape[0] == len(params) == len(num_output_tokens)
    vocab = logits.shape[1]
    rows, cols = [], []
    for i, (p, done) in enumerate(zip(params, num_output_tokens)):
        if done < p.min_tokens:
            banned = p.stop_token_ids + ([] if eos_token_id is None else [eos_token_id])
            banned = [t for t in set(banned) if t < vocab]
            rows += [i] * len(banned)
            cols += banned
    if not rows:
        return logits
    index = (torch.tensor(rows), torch.tensor(cols))                           # 2 x (M,)
    return logits.index_put(index, logits.new_tensor(float("-inf")))                # (R, V)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    prompt_token_ids: list[list[int]],
                    output_token_ids: list[list[int]]) -> torch.Tensor:
    """vLLM's three penalties, in its order.

    - repetition: a token seen in the prompt or the output has a positive logit divided by
      `repetition_penalty`, a non-positive one multiplied by it (both make it less likely
      for a penalty > 1);
    - frequency: minus `frequency_penalty` times the token's count in the output;
    - presence: minus `presence_penalty` once if the token occurs in the output.
    """
    num_rows, vocab = logits.shape
    assert num_rows == len(params) == len(prompt_token_ids) == len(output_token_ids)
    repeat = [p.repetition_penalty != 1.0 for p in params]
    additive = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
    if not any(repeat) and not any(additive):
        return logits
    # Rows that do not need a list get an empty one, so their (neutral) counts cost nothing.
    output_counts = _token_counts(
        [ids if r or a else [] for ids, r, a in zip(output_token_ids, repeat, additive)],
        vocab)                                                                  # (R, V)
    if any(repeat):
        prompt_counts = _token_counts(
            [ids if r else [] for ids, r in zip(prompt_token_ids, repeat)], vocab)  # (R, V)
        seen = (prompt_counts + output_counts) > 0                              # (R, V) bool
        penalty = torch.tensor([p.repetition_penalty for p in params]).unsqueeze(1)  # (R, 1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)    # (R, V)
        logits = torch.where(seen, penalised, logits)                          # (R, V)
    frequency = torch.tensor([p.frequency_penalty for p in params]).unsqueeze(1)    # (R, 1)
    presence = torch.tensor([p.presence_penalty for p in params]).unsqueeze(1)      # (R, 1)
    return logits - frequency * output_counts - presence * (output_counts > 0)      # (R, V)


def _token_counts(token_ids: list[list[int]], vocab: int) -> torch.Tensor:
    """How often each vocabulary entry occurs in each row's list: (R, V) float32."""
    width = max((len(ids) for ids in token_ids), default=0)
    counts = torch.zeros(len(token_ids), vocab + 1)                             # (R, V + 1)
    if width == 0:
        return counts[:, :vocab]
    # Pad with the extra column `vocab`, which is cut off after counting.
    padded = torch.tensor([ids + [vocab] * (width - len(ids)) for ids in token_ids])  # (R, L)
    counts.scatter_add_(1, padded, torch.ones(padded.shape))                   # (R, V + 1)
    return counts[:, :vocab]                                                    # (R, V)


def apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Drops the tokens whose probability is below `min_p` times the row's largest one.

    `logits` must already be divided by the temperature, as in vLLM. A row with min_p = 0 is
    left bit for bit as it was, and the most likely token always stays (min_p <= 1).
    """
    assert logits.shape[0] == len(params)
    if all(p.min_p == 0.0 for p in params):
        return logits
    probs = logits.softmax(dim=-1)                                              # (R, V)
    min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)                # (R, 1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)                        # (R, 1)
    return logits.masked_fill(probs < threshold, float("-inf"))                 # (R, V)
