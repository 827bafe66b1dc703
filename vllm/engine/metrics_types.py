"""What the engine reports to its stat loggers (the log line, Prometheus): one `Stats` per call of
`LLMEngine.do_log_stats`, holding the state now and what happened since the previous call."""

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from vllm.core.scheduler_output import SchedulerOutput
from vllm.sequence import Sequence, SequenceGroup


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
    """Events since the previous `Stats`: the engine records them as they happen (only while a
    stat logger is attached)."""

    num_prompt_tokens: int = 0  # prompts whose first token came (counted once, even if recomputed)
    num_generation_tokens: int = 0
    step_num_tokens: list[int] = field(default_factory=list)  # tokens of each step
    prefill_chunk_tokens: list[int] = field(default_factory=list)  # each prefill chunk scheduled
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # With max_step_latency_ms, of each step sized by the latency target: its token budget, and
    # its predicted and measured seconds.
    step_token_budgets: list[int] = field(default_factory=list)
    predicted_step_seconds: list[float] = field(default_factory=list)
    measured_step_seconds: list[float] = field(default_factory=list)

    def record_step(self, step: SchedulerOutput) -> None:
        self.step_num_tokens.append(step.num_batched_tokens)
        self.prefill_chunk_tokens.extend(s.num_tokens for s in step.scheduled[step.num_decodes:])

    def record_step_time(self, step: SchedulerOutput, seconds: float) -> None:
        if step.token_budget is None:
            return
        self.step_token_budgets.append(step.token_budget)
        self.predicted_step_seconds.append(step.predicted_seconds)
        self.measured_step_seconds.append(seconds)

    def record_token(self, seq: Sequence, now: float) -> None:
        """A token for `seq` at `now`, before its metrics take the time in."""
        self.num_generation_tokens += 1
        metrics = seq.metrics
        if metrics.first_token_time is None:
            if seq.index == 0:  # once per request, not per sample
                self.time_to_first_tokens.append(now - metrics.arrival_time)
                self.num_prompt_tokens += seq.num_prompt_tokens
        else:
            self.inter_token_latencies.append(now - metrics.last_token_time)

    def record_finished(self, group: SequenceGroup) -> None:
        first = group.first
        m = first.metrics
        finished = m.finished_time or time.monotonic()
        self.finished_requests.append(FinishedRequestStats(
            finish_reason=first.status.finish_reason or "abort",
            num_prompt_tokens=first.num_prompt_tokens,
            num_generation_tokens=sum(len(seq.output_token_ids) for seq in group.seqs),
            e2e_latency=finished - m.arrival_time,
            queue_time=None if m.first_scheduled_time is None else m.first_scheduled_time - m.arrival_time,
            prefill_time=(None if m.first_token_time is None or m.first_scheduled_time is None
                          else m.first_token_time - m.first_scheduled_time),
            decode_time=None if m.first_token_time is None else finished - m.first_token_time))


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
