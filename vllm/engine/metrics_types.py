"""What the engine reports to its stat loggers (the log line, Prometheus): one `Stats` per call of
`LLMEngine.do_log_stats`, holding the state now and what happened since the previous call."""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass
class FinishedRequestStats:
    """A request that left the engine: finished, aborted, or refused."""

    finish_reason: str  # "stop", "length" or "abort"
    num_prompt_tokens: int
    num_generation_tokens: int  # over all n samples
    e2e_latency: float  # arrival to finish, seconds
    queue_time: float | None  # arrival to first scheduled; None if it never ran
    prefill_time: float | None  # first scheduled to first token
    decode_time: float | None  # first token to finish


@dataclass
class IterationStats:
    """Events since the previous `Stats`: the engine appends to it as they happen."""

    num_prompt_tokens: int = 0  # prompts whose first token came (counted once, even if recomputed)
    num_generation_tokens: int = 0
    step_num_tokens: list[int] = field(default_factory=list)  # tokens of each step
    prefill_chunk_tokens: list[int] = field(default_factory=list)  # each prefill chunk scheduled
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class Stats:
    now: float  # time.monotonic()
    # The state now.
    num_running: int  # requests with a sample running
    num_waiting: int
    kv_cache_usage: float  # fraction of the KV cache blocks in use, in [0, 1]
    # Counts since the previous Stats.
    num_steps: int
    num_mixed_steps: int  # steps that ran decodes and prefill chunks together
    num_preemptions: int
    num_prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    num_prefix_cache_hits: int  # of those, tokens found there
    iteration: IterationStats


class StatLoggerBase(ABC):
    """Receives every `Stats` of one engine."""

    @abstractmethod
    def log(self, stats: Stats) -> None:
        ...
