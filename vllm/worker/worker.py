"""One rank of the model: its shard of the weights and of the KV cache, and the runner that
steps them. Executors create one per rank, in the engine's process, a worker process or a Ray
actor; each step every rank runs the same `SchedulerOutput`, and rank 0 alone samples."""

import time

from vllm.config import EngineConfig
from vllm.core.scheduler_output import SchedulerOutput
from vllm.distributed import destroy_distributed_environment, init_distributed_environment
from vllm.logger import init_logger
from vllm.model_executor.model_loader import ModelSource, load_model
from vllm.platforms import get_platform
from vllm.worker.graph_stats import GraphStats
from vllm.worker.hpu_model_runner import HPUModelRunner
from vllm.worker.runner_output import ModelRunnerOutput

logger = init_logger(__name__)


class Worker:
    """Rank `config.parallel.rank` of `config.parallel.world_size`. With more than one rank it
    joins the process group at `distributed_init_method` before it builds its shard."""

    def __init__(self, config: EngineConfig, source: ModelSource, eos_token_id: int | None,
                 distributed_init_method: str | None = None) -> None:
        self.config = config
        self.rank = config.parallel.rank
        self.platform = get_platform(config.device)
        world_size = config.parallel.world_size
        if world_size > 1:
            assert distributed_init_method is not None
            self.platform.configure_worker(world_size)
            init_distributed_environment(world_size, self.rank, distributed_init_method,
                                         self.platform.dist_backend)
        self.platform.build_kernels()
        start = time.perf_counter()
        model = load_model(source, config.model.hf_config, config.model.dtype,
                           config.model.max_model_len, self.platform.device, config.model.quantization)
        logger.info("Loaded %s (%s%s) in %.1f s", source.display_name, config.model.dtype,
                    f", TP rank {self.rank} of {world_size}" if world_size > 1 else "",
                    time.perf_counter() - start)
        self.runner = HPUModelRunner(config, self.platform, model, eos_token_id=eos_token_id)
        self.runner.warmup()
        # Made after warm-up, which runs alone and on every thread, so steps start at full width.
        self.threads = self.platform.thread_governor()
        # (tokens, seconds) of a padding-only step at each size, for the step-time model of
        # max_step_latency_ms; every rank runs them, as each forward pass needs all ranks.
        self.step_time_samples: list[tuple[int, float]] = []
        if config.scheduler.max_step_latency_ms is not None:
            self.step_time_samples = self.runner.time_token_sizes()

    @property
    def warmup_report(self) -> tuple[GraphStats, list[tuple[int, float]]]:
        """What the engine learns of warm-up: graph statistics and step-time samples."""
        return self.runner.graph_stats, self.step_time_samples

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput | None:
        """Runs the step on this rank's shard; the sampled output on rank 0, None elsewhere."""
        if self.threads is not None:
            self.threads.before_step()
        # A captured graph runs at the thread count it was captured at: dynamo guards torch's
        # thread count, and after warm-up a graph may not compile again. While the governor has
        # given threads up, steps run eagerly.
        eager = self.threads is not None and not self.threads.at_full_width
        output = self.runner.execute_model(step, eager=eager)
        return output if self.rank == 0 else None

    def shutdown(self) -> None:
        if self.config.parallel.world_size > 1:
            destroy_distributed_environment()
