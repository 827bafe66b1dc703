"""vLLM's `Logprob`: one token's log-probability, rank and text in a logprobs dict."""

from dataclasses import dataclass


@dataclass
class Logprob:
    """`rank` is 1-based (1 = the most likely token); `decoded_token` is the token's text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob, holding the chosen token and the top-k alternatives.
PromptLogprobs = list[dict[int, Logprob] | None]
SampleLogprobs = list[dict[int, Logprob]]
