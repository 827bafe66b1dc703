"""What the engine asks of an executor: run a step on every rank, hand back rank 0's output."""

from abc import ABC, abstractmethod

from vllm.config import EngineConfig
from vllm.core.scheduler_output import SchedulerOutput
from vllm.worker.graph_stats import GraphStats
from vllm.worker.runner_output import ModelRunnerOutput


class WorkerDiedError(RuntimeError):
    """A worker process (or actor) ended while the engine still needed it. The executor has
    stopped its other workers; the engine that owns it is dead."""


class ExecutorBase(ABC):
    """Owns the ranks' workers. `execute_model` sends the step to every rank and returns the
    sampled output; an error a rank raised while running the step is raised again here (the
    engine takes the step back), a rank that died raises `WorkerDiedError`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Rank 0's (tokens, seconds) of padding-only steps, timed after warm-up when
        # max_step_latency_ms is set (Worker.step_time_samples); empty otherwise.
        self.step_time_samples: list[tuple[int, float]] = []

    @abstractmethod
    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        ...

    @property
    def graph_stats(self) -> GraphStats:
        """Rank 0's graph statistics. Executors whose ranks run elsewhere keep those rank 0
        reported after warm-up in `_graph_stats` (a step's counters stay with the rank)."""
        return self._graph_stats

    def shutdown(self) -> None:
        """Stops the workers; idempotent. The default has none to stop."""
