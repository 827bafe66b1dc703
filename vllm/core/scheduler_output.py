"""The step object: the only thing the scheduler hands to the model runner."""

from dataclasses import dataclass, field

from vllm.sampling_params import SamplingParams


@dataclass(slots=True, frozen=True)
class ScheduledSequence:
    """One request's share of a step: `len(token_ids)` tokens starting at `start_position`.

    A decode has one token; a prefill chunk has one or more. `sample` is true when the chunk
    reaches the end of the request's known tokens, so the step's output for its last token is
    the next token (a non-final prefill chunk samples nothing).
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    sample: bool
    sampling_params: SamplingParams

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

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled[self.num_decodes:])

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
