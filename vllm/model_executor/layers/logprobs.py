"""Log-probabilities of chosen tokens and of the top-k alternatives, from raw logits.

As in vLLM, these are the model's own distribution (log_softmax of the logits before
penalties, temperature or filters), so they do not depend on how a token was sampled.
"""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class TokenLogprobs:
    """One position: the chosen token's logprob and 1-based rank, and the top alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


def compute_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]
                     ) -> list[TokenLogprobs]:
    """logits: (R, V) float32; row i chose `token_ids[i]` and wants `num_top[i]` alternatives."""
    assert logits.shape[0] == len(token_ids) == len(num_top)
    logprobs = torch.log_softmax(logits.float(), dim=-1)                       # (R, V)
    chosen_ids = torch.tensor(token_ids, device=logits.device).unsqueeze(1)    # (R, 1)
    chosen = logprobs.gather(1, chosen_ids)                                    # (R, 1)
    # Rank counts the tokens at least as likely as the chosen one, itself included.
    ranks = (logprobs >= chosen).sum(dim=1)                                    # (R,)
    k = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(k, dim=1) if k else (logprobs[:, :0], chosen_ids[:, :0])
    chosen, ranks = chosen.squeeze(1).tolist(), ranks.tolist()
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [TokenLogprobs(token_ids[i], chosen[i], ranks[i], top_ids[i][:num_top[i]],
                          top_values[i][:num_top[i]]) for i in range(len(token_ids))]
