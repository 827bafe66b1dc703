"""The tensor-parallel group of this process and its collectives.

A worker process calls `init_distributed_environment` once, before it builds the model; the
layers then ask `get_tp_group()` for their rank and the world size. A process that never called
it (the single-process executor) is rank 0 of a group of one, where every collective is the
identity. The communication backend is the platform's choice (gloo on CPU, hccl on Gaudi).

Inside a captured graph the all-reduce is the opaque op `vllm::tp_all_reduce`, so the compiler
keeps it whole between the products around it. `timing_collectives()` measures this process's
time in collectives (benchmarks/benchmark_tensor_parallel.py reads it in each worker).
"""

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vllm.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class GroupCoordinator:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, on every rank (a new tensor)."""
        if self.world_size == 1:
            return x
        if torch.compiler.is_compiling():
            return torch.ops.vllm.tp_all_reduce(x)
        return _all_reduce(x)

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """The ranks' `x`, which must have one shape, concatenated along `dim` on rank 0; None on
        the other ranks."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        with _timed("gather", x):
            dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=dim) if self.rank == 0 else None


_TP_GROUP = GroupCoordinator()


def get_tp_group() -> GroupCoordinator:
    return _TP_GROUP


@dataclass
class CollectiveTimes:
    """Wall-clock seconds, calls and payload bytes of this process's collectives, by kind."""

    seconds: dict[str, float]
    calls: dict[str, int]
    bytes: dict[str, int]


_TIMES: CollectiveTimes | None = None


@contextlib.contextmanager
def timing_collectives() -> Iterator[CollectiveTimes]:
    """Within the block, every all-reduce and gather of this process adds its time to the
    yielded `CollectiveTimes` (a rank waiting for a slower one counts the wait too)."""
    global _TIMES
    assert _TIMES is None, "collectives are already being timed"
    _TIMES = CollectiveTimes({}, {}, {})
    try:
        yield _TIMES
    finally:
        _TIMES = None


@contextlib.contextmanager
def _timed(kind: str, x: torch.Tensor) -> Iterator[None]:
    if _TIMES is None:
        yield
        return
    times, start = _TIMES, time.perf_counter()
    yield
    times.seconds[kind] = times.seconds.get(kind, 0.0) + time.perf_counter() - start
    times.calls[kind] = times.calls.get(kind, 0) + 1
    times.bytes[kind] = times.bytes.get(kind, 0) + x.numel() * x.element_size()


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    with _timed("all_reduce", out):
        dist.all_reduce(out)
    return out


@torch.library.custom_op("vllm::tp_all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor) -> torch.Tensor:
    return _all_reduce(x)


@_all_reduce_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _TP_GROUP.all_reduce(x)


def init_distributed_environment(world_size: int, rank: int, init_method: str, backend: str) -> None:
    """Joins the process group of `world_size` ranks (all of them tensor-parallel ranks: no
    pipeline or data parallelism inside one engine) and makes it this process's TP group."""
    global _TP_GROUP
    assert _TP_GROUP.world_size == 1, "the distributed environment is already initialised"
    logger.info("world_size=%d rank=%d distributed_init_method=%s backend=%s", world_size, rank,
                init_method, backend)
    dist.init_process_group(backend=backend, init_method=init_method, world_size=world_size, rank=rank)
    _TP_GROUP = GroupCoordinator(rank=rank, world_size=world_size)
    logger.info("rank %d in world size %d is assigned as DP rank 0, PP rank 0, TP rank %d", rank,
                world_size, rank)


def destroy_distributed_environment() -> None:
    global _TP_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP = GroupCoordinator()
