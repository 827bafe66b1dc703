"""Turns the logits of the sampling rows into token ids: greedy, or temperature/top-k/top-p."""

import torch

from vllm.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> list[int]:
    """logits: (S, vocab) float32, one row per sampling request; `generators[i]` draws row i.

    Random rows use the exponential race (argmax of p / E with E ~ Exp(1)), which picks token j
    with probability p_j and consumes a fixed amount of the row's own random stream, so a seeded
    request's tokens do not depend on the other rows.
    """
    assert logits.shape[0] == len(params) == len(generators)
    tokens = logits.argmax(dim=-1)                                          # (S,)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        random_rows = torch.tensor(rows)
        tokens[random_rows] = _sample_random(logits[random_rows], [params[i] for i in rows],
                                             [generators[i] for i in rows])
    return tokens.tolist()


def _sample_random(logits: torch.Tensor, params: list[SamplingParams],
                   generators: list[torch.Generator]) -> torch.Tensor:
    """logits: (R, V) -> (R,) token ids."""
    num_rows, vocab = logits.shape
    temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)   # (R, 1)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)

    sorted_logits, order = (logits / temperature).sort(dim=-1, descending=True)  # (R, V)
    rank = torch.arange(vocab).unsqueeze(0)                                    # (1, V)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already cover top_p (the first always stays).
    mass_above = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_above > top_p, 0.0)

    noise = torch.empty_like(probs)
    for i, gen in enumerate(generators):
        noise[i].exponential_(generator=gen)
    choice = (probs / noise).argmax(dim=-1, keepdim=True)                     # (R, 1)
    return order.gather(1, choice).squeeze(1)
