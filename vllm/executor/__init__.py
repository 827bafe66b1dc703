"""Executors: what runs the model's ranks for the engine (`distributed_executor_backend`).

    uni   one rank in the engine's process (the default for tensor_parallel_size=1)
    mp    one worker process per rank on this host (the default for more)
    ray   one Ray actor per rank, in a placement group that may span hosts (`ray` is imported
          only when this backend is chosen)
"""

from vllm.config import ParallelConfig
from vllm.executor.executor_base import ExecutorBase, WorkerDiedError

__all__ = ["ExecutorBase", "WorkerDiedError", "get_executor_class"]


def get_executor_class(parallel: ParallelConfig) -> type[ExecutorBase]:
    backend = parallel.distributed_executor_backend
    if backend == "uni":
        from vllm.executor.uniproc_executor import UniProcExecutor

        return UniProcExecutor
    if backend == "mp":
        from vllm.executor.mp_executor import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from vllm.executor.ray_executor import RayExecutor

        return RayExecutor
    raise AssertionError(backend)  # ParallelConfig checked it
