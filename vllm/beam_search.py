"""Beam search over the engine, as `LLM.beam_search` runs it (vLLM's API and scoring).

Each step extends every live beam by one token: the engine runs each beam as a request for one
token with the top 2 x beam_width logprobs, and the prefix cache holds the beams' shared KV
blocks, so a step computes little more than each beam's last token. Of a prompt's candidates,
those that end with EOS are finished; of the rest, the beam_width most likely go on.
"""

from dataclasses import dataclass, field

from vllm.logprobs import Logprob


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters. `length_penalty` divides a finished beam's log-probability
    by its length (prompt included) to that power when beams are ranked."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` include the prompt; `logprobs` has one dict per generated token (the
    token's and its rivals'); `text` is the generated text, set when the search ends."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | None = None  # the EOS id that ended it


@dataclass
class BeamSearchOutput:
    """A prompt's best `beam_width` beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(beam: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    """The beam's log-probability over its length to the power `length_penalty` (its EOS does not
    count toward the length)."""
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] == eos_token_id else 0)
    return beam.cum_logprob / (length ** length_penalty)


def extend(beam: BeamSearchSequence, top: dict[int, Logprob], eos_token_id: int | None,
           ignore_eos: bool) -> list[BeamSearchSequence]:
    """The beam's candidates: one per token of `top` (one step's logprobs)."""
    return [BeamSearchSequence(tokens=[*beam.tokens, token], logprobs=[*beam.logprobs, top],
                               cum_logprob=beam.cum_logprob + entry.logprob,
                               finish_reason="stop" if token == eos_token_id and not ignore_eos else None,
                               stop_reason=token if token == eos_token_id and not ignore_eos else None)
            for token, entry in top.items()]
