"""Data parallelism (`data_parallel_size`): N whole engines as Ray actors behind one client.

`DataParallelEngine` offers what the server uses of `AsyncLLMEngine` (generate, abort, the stat
loggers, errored, shutdown), so `vllm serve --data-parallel-size N` runs the same handlers on it:

    server ── generate ──► DataParallelEngine ── least loaded ──► EngineReplica i (Ray actor)
                                   ▲                                  AsyncLLMEngine, its own
                                   └──── RequestOutputs streamed ──── scheduler, KV cache, model

A request goes to the replica with the fewest requests in flight (open streams), the lowest
index among equals, and stays there. Each replica is an async Ray actor: its `generate` is an
async generator that Ray streams back output by output. The replicas share the host's cores
(each gets cores // N threads and one Ray CPU). The client joins the Ray cluster the process is
connected to, or starts a local one without a dashboard, which it stops at shutdown. `ray` is
imported only here.

Statistics: each replica's engine hands its `Stats` to a collector; `do_log_stats` gathers them
and gives the client's loggers one merged `Stats`: running and waiting requests and every count
and event list sum over replicas, and the KV cache usage is the replicas' mean (their caches are
the same size, so it is the fraction of all blocks in use). Per-replica request counts are in
`requests_per_replica` and in a log line.
"""

import asyncio
import dataclasses
import os
import time
from collections.abc import AsyncIterator

import ray
import torch

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.engine.async_llm_engine import AsyncEngineDeadError, AsyncLLMEngine
from vllm.engine.metrics_types import IterationStats, StatLoggerBase, Stats
from vllm.inputs import ProcessedPrompt, PromptType
from vllm.logger import init_logger
from vllm.model_executor.model_loader import load_tokenizer
from vllm.outputs import RequestOutput
from vllm.platforms import get_platform
from vllm.sampling_params import SamplingParams

logger = init_logger(__name__)

_COLLECTOR = "data_parallel"


class _StatsCollector(StatLoggerBase):
    """Keeps a replica's `Stats` until the client fetches them."""

    def __init__(self) -> None:
        self.pending: list[Stats] = []

    def log(self, stats: Stats) -> None:
        self.pending.append(stats)


class EngineReplica:
    """The Ray actor around one replica's `AsyncLLMEngine`."""

    def __init__(self, engine_args: AsyncEngineArgs, index: int, num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        self.index = index
        self.engine = AsyncLLMEngine.from_engine_args(engine_args)
        self.collector: _StatsCollector | None = None

    def describe(self) -> dict:
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "num_threads": torch.get_num_threads()}

    async def generate(self, prompt: PromptType | ProcessedPrompt, params: SamplingParams,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        async for out in self.engine.generate(prompt, params, request_id, priority):
            yield out

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def collect_stats(self, enable: bool) -> None:
        if enable and self.collector is None:
            self.collector = _StatsCollector()
            self.engine.engine.add_logger(_COLLECTOR, self.collector)
        elif not enable and self.collector is not None:
            self.engine.engine.remove_logger(_COLLECTOR)
            self.collector = None

    async def fetch_stats(self) -> list[Stats]:
        """The Stats since the previous fetch, the last one taken now."""
        if self.collector is None:
            return []
        await self.engine.do_log_stats()
        stats, self.collector.pending = self.collector.pending, []
        return stats

    async def shutdown(self) -> None:
        await self.engine.shutdown()
        self.engine.engine.shutdown()


def merge_stats(per_replica: list[list[Stats]], now: float) -> Stats | None:
    """One Stats for all replicas: the state of each one's latest, summed (the KV cache usage
    averaged), and the counts and events of all of them. None if a replica sent nothing."""
    if not all(per_replica):
        return None
    latest = [stats[-1] for stats in per_replica]
    every = [s for stats in per_replica for s in stats]
    iteration = IterationStats()
    for field in dataclasses.fields(IterationStats):
        parts = [getattr(s.iteration, field.name) for s in every]
        setattr(iteration, field.name, sum(parts, [] if isinstance(parts[0], list) else 0))
    return Stats(
        now=now,
        num_running=sum(s.num_running for s in latest),
        num_waiting=sum(s.num_waiting for s in latest),
        kv_cache_usage=sum(s.kv_cache_usage for s in latest) / len(latest),
        num_steps=sum(s.num_steps for s in every),
        num_mixed_steps=sum(s.num_mixed_steps for s in every),
        num_preemptions=sum(s.num_preemptions for s in every),
        num_prefix_cache_queries=sum(s.num_prefix_cache_queries for s in every),
        num_prefix_cache_hits=sum(s.num_prefix_cache_hits for s in every),
        iteration=iteration)


class DataParallelEngine:
    """`data_parallel_size` replicas of the engine, each a Ray actor, behind one async interface.

    Invariants: `in_flight[i]` counts the streams open on replica i (a stream closes when its
    request finishes, fails or is aborted); a request id maps to its replica while its stream is
    open. A replica that dies, or whose engine dies, makes the whole client dead (`errored`,
    so /health answers 503): that replica's streams and every later request fail with
    AsyncEngineDeadError, while the streams already open on the other replicas finish.
    """

    def __init__(self, engine_args: AsyncEngineArgs) -> None:
        size = engine_args.data_parallel_size
        assert size > 1
        # Bad arguments fail here, before any replica starts.
        self.config, _, tokenizer_source = engine_args.create_engine_config(get_platform(engine_args.device))
        self.tokenizer = load_tokenizer(tokenizer_source)
        self.in_flight = [0] * size
        self.requests_per_replica = [0] * size  # routed since start
        self._replica_of: dict[str, int] = {}
        self._stat_loggers: dict[str, StatLoggerBase] = {}
        self._dead_error: BaseException | None = None
        self._logged_counts: list[int] | None = None
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(include_dashboard=False)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // size)
        replica_args = dataclasses.replace(engine_args, data_parallel_size=1)
        actor_class = ray.remote(EngineReplica)
        self._replicas = [actor_class.options(num_cpus=1).remote(replica_args, i, threads)
                          for i in range(size)]
        try:
            places = ray.get([r.describe.remote() for r in self._replicas])
        except BaseException:
            self._kill_replicas()
            raise
        self.replica_pids = [p["pid"] for p in places]
        for i, place in enumerate(places):
            logger.info("Data-parallel replica %d of %d: pid %d on node %s, %d thread(s)", i, size,
                        place["pid"], place["node_id"][:8], place["num_threads"])

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs) -> "DataParallelEngine":
        return cls(engine_args)

    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    @property
    def num_unfinished_requests(self) -> int:
        return sum(self.in_flight)

    async def get_tokenizer(self):
        return self.tokenizer

    # ---------------------------------------------------------------- requests

    def _pick_replica(self) -> int:
        return min(range(len(self._replicas)), key=lambda i: self.in_flight[i])  # ties: lowest index

    async def generate(self, prompt: PromptType | ProcessedPrompt, sampling_params: SamplingParams,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """As `AsyncLLMEngine.generate`, on the least loaded replica."""
        self._check_alive()
        if request_id in self._replica_of:
            raise ValueError(f"request_id {request_id!r} is already in use")
        index = self._pick_replica()
        replica = self._replicas[index]
        self._replica_of[request_id] = index
        self.in_flight[index] += 1
        self.requests_per_replica[index] += 1
        finished = False
        try:
            async for ref in replica.generate.remote(prompt, sampling_params, request_id, priority):
                out = await self._result(ref, index)
                finished = out.finished
                yield out
        finally:
            del self._replica_of[request_id]
            self.in_flight[index] -= 1
            if not finished and self._dead_error is None:  # the consumer left early
                await asyncio.shield(self._abort_on(index, request_id))

    async def _result(self, ref, index: int) -> RequestOutput:
        try:
            return await ref
        except ray.exceptions.RayActorError as e:
            self._dead_error = e
            raise AsyncEngineDeadError(f"data-parallel replica {index} died; the engine serves no "
                                       "more requests") from e
        except AsyncEngineDeadError as e:  # Ray's error is also an instance of the replica's
            self._dead_error = e
            raise

    async def abort(self, request_id: str) -> None:
        index = self._replica_of.get(request_id)
        if index is not None:
            await self._abort_on(index, request_id)

    async def _abort_on(self, index: int, request_id: str) -> None:
        try:
            await self._replicas[index].abort.remote(request_id)
        except ray.exceptions.RayActorError:
            pass  # the replica is gone, and its requests with it

    def _check_alive(self) -> None:
        if not self._replicas:
            raise AsyncEngineDeadError("the engine was shut down")
        if self._dead_error is not None:
            raise AsyncEngineDeadError("a data-parallel replica has died") from self._dead_error

    # ---------------------------------------------------------------- statistics

    def add_logger(self, name: str, stat_logger: StatLoggerBase) -> None:
        if name in self._stat_loggers:
            raise KeyError(f"a stat logger named {name!r} is already attached")
        self._stat_loggers[name] = stat_logger
        if len(self._stat_loggers) == 1:
            ray.get([r.collect_stats.remote(True) for r in self._replicas])

    def remove_logger(self, name: str) -> None:
        del self._stat_loggers[name]
        if not self._stat_loggers and self._replicas:
            ray.get([r.collect_stats.remote(False) for r in self._replicas])

    async def do_log_stats(self) -> None:
        """Hands the loggers the replicas' merged Stats as of now, and logs the requests each
        replica was given when that changed."""
        if self._logged_counts != self.requests_per_replica:
            self._logged_counts = list(self.requests_per_replica)
            logger.info("Data-parallel requests per replica: %s (in flight: %s)",
                        self._logged_counts, self.in_flight)
        if not self._stat_loggers or self._dead_error is not None:
            return
        try:
            per_replica = await asyncio.gather(*(r.fetch_stats.remote() for r in self._replicas))
        except ray.exceptions.RayActorError as e:
            self._dead_error = e
            return
        stats = merge_stats(per_replica, time.monotonic())
        if stats is not None:
            for stat_logger in self._stat_loggers.values():
                stat_logger.log(stats)

    # ---------------------------------------------------------------- shutdown

    async def shutdown(self) -> None:
        """Stops every replica's engine and actor (and Ray, if it was started here); open
        streams end with an error. Idempotent."""
        if not self._replicas:
            return
        await asyncio.gather(*(r.shutdown.remote() for r in self._replicas), return_exceptions=True)
        self._kill_replicas()

    def _kill_replicas(self) -> None:
        replicas, self._replicas = self._replicas, []
        for replica in replicas:
            ray.kill(replica)
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
