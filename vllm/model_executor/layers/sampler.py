"""Turns the logits of the sampling rows into token ids.

Order, as in vLLM: grammar masks, allowed token ids, bad words, min_tokens masking, logit bias
and penalties, then greedy argmax or temperature, min_p, top-k and top-p, then one draw per row.
"""

import torch

from vllm.model_executor.layers.logits_processors import (apply_allowed_token_ids, apply_bad_words,
                                                          apply_logit_bias, apply_min_p, apply_min_tokens,
                                                          apply_penalties, apply_token_masks)
from vllm.sampling_params import SamplingParams


def sample_with_processors(logits: torch.Tensor, params: list[SamplingParams],
                           generators: list[torch.Generator],
                           prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
                           eos_token_id: int | None,
                           token_masks: list[torch.Tensor | None] | None = None) -> list[int]:
    """The model runner's entry point: logits (S, vocab) float32, one row per sampling request.

    Row i belongs to the request with `params[i]`, `generators[i]`, the tokens generated so far
    `output_token_ids[i]` and its grammar's mask `token_masks[i]` (see apply_token_masks).
    Greedy rows see every processor here too.
    """
    logits = apply_token_masks(logits, token_masks)                            # (S, V)
    logits = apply_allowed_token_ids(logits, params)                           # (S, V)
    logits = apply_bad_words(logits, params, output_token_ids)                 # (S, V)
    logits = apply_min_tokens(logits, params, [len(ids) for ids in output_token_ids],
                              eos_token_id)                                     # (S, V)
    logits = apply_logit_bias(logits, params)                                  # (S, V)
    logits = apply_penalties(logits, params, prompt_token_ids, output_token_ids)  # (S, V)
    return sample(logits, params, generators)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> list[int]:
    """logits: (S, vocab) float32, one row per sampling request; `generators[i]` draws row i.

    Each random row draws once from its own generator, consuming a fixed amount of that stream,
    so a seeded request's tokens do not depend on the other rows.
    """
    assert logits.shape[0] == len(params) == len(generators)
    # The first maximal index, as torch's argmax and max(dim) give it; numpy's argmax is a
    # vectorized pass over the row, several times faster on the host than either.
    tokens = logits.numpy().argmax(axis=-1)                                  # (S,) int64
    # Rows with top-k/top-p filters draw in rank order, the others in vocabulary order; each
    # kind is sampled on its own so a row's draw never depends on which rows share the batch.
    # min_p keeps a row in vocabulary order: it removes tokens without needing their ranks.
    for filtered in (False, True):
        rows = [i for i, p in enumerate(params)
                if not p.greedy and (p.top_k > 0 or p.top_p < 1.0) == filtered]
        if rows:
            index = torch.tensor(rows)
            tokens[rows] = _sample_random(logits[index], [params[i] for i in rows],
                                          [generators[i] for i in rows], filtered).numpy()
    return tokens.tolist()


def _sample_random(logits: torch.Tensor, params: list[SamplingParams],
                   generators: list[torch.Generator], filtered: bool) -> torch.Tensor:
    """logits: (R, V) -> (R,) token ids."""
    num_rows, vocab = logits.shape
    temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)   # (R, 1)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)

    scaled = logits / temperature                                              # (R, V)
    scaled = apply_min_p(scaled, params)                                       # (R, V)
    if filtered:  # filters need the tokens in rank order
        scaled, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(vocab).unsqueeze(0)                                # (1, V)
        scaled = scaled.masked_fill(rank >= top_k, float("-inf"))
    probs = scaled.softmax(dim=-1)
    if filtered:
        # Drop a token when the tokens ranked above it already cover top_p (the first stays).
        mass_above = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_above > top_p, 0.0)

    # Inverse CDF: one uniform number per row from the row's own generator, where
    # torch.multinomial draws one exponential per vocabulary entry.
    cdf = probs.cumsum(dim=-1)                                                  # (R, V)
    u = torch.cat([torch.rand(1, generator=gen) for gen in generators]).unsqueeze(1) * cdf[:, -1:]
    # right=True: the first token whose cumulative mass exceeds u, so zero-mass tokens never win.
    choice = torch.searchsorted(cdf, u, right=True).clamp_(max=vocab - 1)    # (R, 1)
    return (order.gather(1, choice) if filtered else choice).squeeze(1)

