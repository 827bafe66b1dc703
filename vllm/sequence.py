"""The state of one request as it moves through the engine."""

import enum
from dataclasses import dataclass, field

from vllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()   # EOS or a stop token
    FINISHED_LENGTH = enum.auto()    # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()   # could never be scheduled (too long for the model or cache)

    @property
    def finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)

    @property
    def finish_reason(self) -> str | None:
        return {
            SequenceStatus.FINISHED_STOPPED: "stop",
            SequenceStatus.FINISHED_LENGTH: "length",
            SequenceStatus.FINISHED_ABORTED: "abort",
            SequenceStatus.FINISHED_IGNORED: "length",
        }.get(self)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(eq=False)
class Sequence:
    """One request: its tokens, how many of them are in the KV cache, and its status.

    There is no prefill or decode phase: `num_computed_tokens` counts the tokens whose KV is in
    the cache, and a step may compute any number of the `num_tokens - num_computed_tokens` left.
    When that reaches zero the request samples a token and the difference is 1 again (a decode).
    Preemption by recompute sets `num_computed_tokens` back to 0; generated tokens then count as
    prompt for the recomputation.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    # Incremental detokenization state (see engine/detokenizer.py).
    output_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    # Why the request was ignored, for FINISHED_IGNORED.
    error: str | None = None
    stop_reason: int | str | None = None
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the last sampled token is missing from the KV cache."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output, without copying both lists."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]
