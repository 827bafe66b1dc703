"""Tensor-parallel ranks as Ray actors (`distributed_executor_backend="ray"`), the way to span hosts.

The executor reserves one bundle per rank in a placement group (one unit of the platform's Ray
resource each: a CPU here, an HPU on Gaudi), starts an actor in each bundle, and has them join
one process group whose rendezvous is a free port on rank 0's node. Each step the
`SchedulerOutput` is put in Ray's object store once and every actor runs it; rank 0's output is
the step's. An error a rank raised is raised again here in its own type; an actor that died
raises `WorkerDiedError`. The executor joins the Ray cluster the process is connected to
(`ray.init(address=...)` beforehand), or starts a local one without a dashboard, which it stops at
shutdown. `ray` is imported only here.
"""

import dataclasses
import os
import socket
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vllm.config import EngineConfig
from vllm.core.scheduler_output import SchedulerOutput
from vllm.executor.executor_base import ExecutorBase, WorkerDiedError
from vllm.executor.mp_executor import PEER_ERROR_GRACE_SECONDS
from vllm.logger import init_logger
from vllm.model_executor.model_loader import ModelSource
from vllm.platforms import get_platform
from vllm.worker.graph_stats import GraphStats
from vllm.worker.runner_output import ModelRunnerOutput

logger = init_logger(__name__)

PLACEMENT_TIMEOUT_SECONDS = 60.0


class RayWorkerWrapper:
    """The actor around one rank's `Worker`, built once the group's rendezvous is known."""

    def __init__(self) -> None:
        self.worker = None

    def init_method(self) -> str:
        """A free TCP port on this actor's node, for the process group's rendezvous."""
        node_id = ray.get_runtime_context().get_node_id()
        # The address the node joined the cluster with (127.0.0.1 for a cluster on loopback).
        ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return f"tcp://{ip}:{s.getsockname()[1]}"

    def init_worker(self, config: EngineConfig, source: ModelSource, eos_token_id: int | None,
                    init_method: str) -> tuple[GraphStats, list[tuple[int, float]]] | None:
        from vllm.worker.worker import Worker

        self.worker = Worker(config, source, eos_token_id, init_method)
        return self.worker.warmup_report if self.worker.rank == 0 else None

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.worker.execute_model(step)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


class RayExecutor(ExecutorBase):
    def __init__(self, config: EngineConfig, source: ModelSource, eos_token_id: int | None) -> None:
        super().__init__(config)
        self._actors = []
        self.worker_pids: list[int] = []
        self._placement_group = None
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(include_dashboard=False)
        world_size = config.parallel.world_size
        device_key = get_platform(config.device).ray_device_key
        self._placement_group = placement_group([{device_key: 1}] * world_size)
        try:
            ready, _ = ray.wait([self._placement_group.ready()], timeout=PLACEMENT_TIMEOUT_SECONDS)
            if not ready:
                raise ValueError(f"the Ray cluster cannot place {world_size} ranks of one {device_key} "
                                 f"each within {PLACEMENT_TIMEOUT_SECONDS:.0f} s (cluster resources: "
                                 f"{ray.cluster_resources()})")
            actor_class = ray.remote(RayWorkerWrapper)
            for index in range(world_size):
                strategy = PlacementGroupSchedulingStrategy(placement_group=self._placement_group,
                                                            placement_group_bundle_index=index)
                # Ray names CPUs apart from custom resources.
                resources = {"num_cpus": 1} if device_key == "CPU" else {"num_cpus": 0,
                                                                         "resources": {device_key: 1}}
                self._actors.append(actor_class.options(scheduling_strategy=strategy, **resources).remote())
            init_method = ray.get(self._actors[0].init_method.remote())
            self.node_ids = ray.get([a.node_id.remote() for a in self._actors])
            self.worker_pids = ray.get([a.pid.remote() for a in self._actors])
            logger.info("Started %d Ray actors on nodes %s; rendezvous %s", world_size,
                        [n[:8] for n in self.node_ids], init_method)
            refs = [actor.init_worker.remote(
                dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, rank=rank)),
                source, eos_token_id, init_method) for rank, actor in enumerate(self._actors)]
            self._graph_stats, self.step_time_samples = self._collect(refs)
        except BaseException:
            self.shutdown()
            raise

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        if not self._actors:
            raise WorkerDiedError("the executor's Ray actors were stopped")
        step_ref = ray.put(step)  # serialized once for all ranks
        return self._collect([actor.execute_model.remote(step_ref) for actor in self._actors])

    def _collect(self, refs: list) -> object:
        """Every rank's result; rank 0's is returned. A rank's error is raised once all have
        answered (or PEER_ERROR_GRACE_SECONDS after it); a dead actor raises WorkerDiedError."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending, results, error, deadline = list(refs), {}, None, None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                self.shutdown()
                raise WorkerDiedError(f"{len(pending)} rank(s) did not answer within "
                                      f"{PEER_ERROR_GRACE_SECONDS} s of another rank's error "
                                      f"({type(error).__name__}: {error})") from error
            ref = ready[0]
            try:
                results[rank_of[ref]] = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                rank = rank_of[ref]
                self.shutdown()
                # Ray's own account (exit type, likely causes) stays in the cause.
                raise WorkerDiedError(f"the Ray actor of TP rank {rank} (pid {self.worker_pids[rank]}) "
                                      "died; the other actors were stopped") from e
            except ray.exceptions.RayTaskError as e:
                error = error or e.as_instanceof_cause()
                deadline = deadline or time.monotonic() + PEER_ERROR_GRACE_SECONDS
        if error is not None:
            raise error
        return results[0]

    def shutdown(self) -> None:
        actors, self._actors = self._actors, []
        for actor in actors:
            ray.kill(actor)
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)
            self._placement_group = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __del__(self) -> None:
        if self._actors and ray.is_initialized():
            self.shutdown()
