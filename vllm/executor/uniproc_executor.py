"""One rank, in the engine's own process: the worker is called directly."""

from vllm.config import EngineConfig
from vllm.core.scheduler_output import SchedulerOutput
from vllm.executor.executor_base import ExecutorBase
from vllm.model_executor.model_loader import ModelSource
from vllm.worker.graph_stats import GraphStats
from vllm.worker.hpu_model_runner import HPUModelRunner
from vllm.worker.runner_output import ModelRunnerOutput
from vllm.worker.worker import Worker


class UniProcExecutor(ExecutorBase):
    def __init__(self, config: EngineConfig, source: ModelSource, eos_token_id: int | None) -> None:
        super().__init__(config)
        assert config.parallel.world_size == 1
        self.worker = Worker(config, source, eos_token_id)
        self.step_time_samples = self.worker.step_time_samples

    @property
    def runner(self) -> HPUModelRunner:
        return self.worker.runner

    @property
    def graph_stats(self) -> GraphStats:
        return self.worker.runner.graph_stats

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(step)
