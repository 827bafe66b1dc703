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
    FINISHED_ERROR = enum.auto()     # its steps kept failing (see LLMEngine.step)

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
            SequenceStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
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
    eos_token_id: int | None = None  # the tokenizer's; ends the request unless ignore_eos
    priority: int = 0  # under the priority scheduling policy, lower values are served first
    cache_salt: str | None = None  # prefix-cache blocks are shared only with the same salt
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # Prompt positions whose prediction of the next prompt token was handed out (prompt
    # logprobs); unlike num_computed_tokens, preemption keeps it, so none is computed twice.
    num_prompt_logprob_positions: int = 0
    num_preemptions: int = 0
    num_failed_steps: int = 0  # steps with this request that failed and were taken back
    # Tokens found in the prefix cache when the request was first admitted (None until then).
    num_cached_tokens: int | None = None
    # Incremental detokenization state (see engine/detokenizer.py).
    output_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    # Why the request was ignored or failed, for FINISHED_IGNORED and FINISHED_ERROR.
    error: str | None = None
    stop_reason: int | str | None = None
    # Parallel sampling (n > 1): the other samples of this prompt, forked from this sequence
    # once its prompt is in the cache (they share its blocks), and this sample's index.
    pending_forks: list["Sequence"] = field(default_factory=list)
    index: int = 0
    # Per generated token: the Logprob dicts, when the request asks for logprobs.
    output_logprobs: list[dict] = field(default_factory=list)
    cumulative_logprob: float = 0.0
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

    @property
    def num_seats(self) -> int:
        """Sequences this one stands for in the `max_num_seqs` limit (itself and its forks)."""
        return 1 + len(self.pending_forks)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output, without copying both lists."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]


@dataclass(eq=False)
class SequenceGroup:
    """One user request: its prompt and its `n` samples, each a `Sequence`.

    With n = 1 the sample's id is the request id. With n > 1 sample i has the id
    `f"{i}_{request_id}"`; sample 0 computes the prompt and holds the others in
    `pending_forks` until the prompt is in the cache. `prompt_logprobs` starts as `[None]` (the
    first prompt token has no prediction) and gains one entry per prompt position as chunks run.
    """

    request_id: str
    seqs: list[Sequence]
    prompt_logprobs: list | None = None

    @property
    def first(self) -> Sequence:
        return self.seqs[0]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
