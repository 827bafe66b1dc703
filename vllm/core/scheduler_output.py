"""The step object: the only thing the scheduler hands to the model runner."""

from dataclasses import dataclass, field
from typing import Any

from vllm.sampling_params import SamplingParams


@dataclass(slots=True, frozen=True)
class ScheduledSequence:
    """One request's share of a step: `len(token_ids)` tokens starting at `start_position`.

    A decode has one token; a prefill chunk has one or more. `sample` is true when the chunk
    reaches the end of the request's known tokens, so the step's output for its last token is
    the next token (a non-final prefill chunk samples nothing). `forks` lists further samples
    (request id, params) to draw from that same output row: the other samples of an n > 1
    request, drawn when its prompt completes. `prompt_logprob_targets[i]` is the prompt token
    that position `prompt_logprobs_start + i` of the chunk predicts, for requests that ask for
    prompt logprobs (it may cover fewer rows than the chunk: the last prompt position predicts
    a generated token, and positions already handed out before a preemption are left out).
    `prompt_token_ids` and `output_token_ids` are the request's own lists, read by penalties.
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    forks: tuple[tuple[str, SamplingParams], ...] = ()
    prompt_logprobs_start: int = 0
    prompt_logprob_targets: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens of this request already in the KV cache before this step."""
        return self.start_position


@dataclass(slots=True)
class SchedulerOutput:
    """Everything one forward pass runs, flattened in this order: decodes, then prefill chunks."""

    scheduled: list[ScheduledSequence]
    num_decodes: int
    # Requests that finished since the previous step, so the runner can drop their state.
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # (source, destination) KV blocks to copy before the forward pass: the partial last prompt
    # block of each sample forked since the previous step.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Per sample id with structured outputs, the packed bitmask of the tokens its grammar allows
    # next (a (ceil(vocab / 32),) int32 tensor, bit j of word i for token 32 i + j); set by the
    # engine after scheduling (vllm/engine/structured_output.py).
    token_masks: dict[str, Any] = field(default_factory=dict)
    # With a latency target: the token budget chosen for this step and its predicted seconds.
    token_budget: int | None = None
    predicted_seconds: float | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled[self.num_decodes:])

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
