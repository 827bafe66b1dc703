"""Tensor-parallel ranks as worker processes on this host (`distributed_executor_backend="mp"`).

Every rank, rank 0 included, is a process started with `spawn`; the engine's process keeps the
scheduler and block manager and only sends steps and reads outputs. Each worker has a pipe to
the engine:

    engine ──SchedulerOutput──► every worker: the forward on its shard, collectives among them
    engine ◄──("ok", output)─── rank 0 (the sampled tokens); the others ("ok", None)
    engine ◄──("error", exc)─── a rank whose step raised; the engine takes the step back

The engine waits on the pipes and on the processes' sentinels together, so a worker that dies
is seen at once: the executor then stops the others and raises `WorkerDiedError`. A worker exits
when its pipe closes, so none outlives the engine's process; workers ignore Ctrl-C, which is the
engine's to handle.
"""

import dataclasses
import multiprocessing
import signal
import socket
import time
import weakref
from multiprocessing.connection import Connection, wait

from vllm.config import EngineConfig
from vllm.core.scheduler_output import SchedulerOutput
from vllm.executor.executor_base import ExecutorBase, WorkerDiedError
from vllm.logger import init_logger
from vllm.model_executor.model_loader import ModelSource
from vllm.worker.runner_output import ModelRunnerOutput

logger = init_logger(__name__)

# After one rank reports an error, how long the others may take to report theirs: a rank still
# waiting in a collective for the failed one would otherwise hold the engine until gloo's timeout.
PEER_ERROR_GRACE_SECONDS = 10.0
SHUTDOWN_GRACE_SECONDS = 5.0


def loopback_init_method() -> str:
    """A free TCP port on 127.0.0.1 for the process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _picklable(error: BaseException) -> BaseException:
    import pickle

    try:
        pickle.dumps(error)
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _worker_main(conn: Connection, config: EngineConfig, source: ModelSource, eos_token_id: int | None,
                 init_method: str) -> None:
    """The body of a worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from vllm.worker.worker import Worker

    try:
        worker = Worker(config, source, eos_token_id, init_method)
    except BaseException as e:
        conn.send(("error", _picklable(e)))
        return
    conn.send(("ok", worker.warmup_report if worker.rank == 0 else None))
    try:
        while True:
            try:
                step = conn.recv()
            except EOFError:  # the engine is gone
                break
            if step is None:
                break
            try:
                reply = ("ok", worker.execute_model(step))
            except Exception as e:
                reply = ("error", _picklable(e))
            conn.send(reply)
    finally:
        worker.shutdown()


@dataclasses.dataclass
class _WorkerHandle:
    rank: int
    process: multiprocessing.process.BaseProcess
    conn: Connection


def _stop_workers(workers: list[_WorkerHandle]) -> None:
    """Asks every worker to exit, then terminates, then kills those that did not."""
    for w in workers:
        try:
            w.conn.send(None)
        except (OSError, ValueError):
            pass  # already gone
    deadline = time.monotonic() + SHUTDOWN_GRACE_SECONDS
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.process.is_alive():
            w.process.terminate()
            w.process.join(1.0)
        if w.process.is_alive():
            w.process.kill()
            w.process.join()
        w.conn.close()


class MultiprocExecutor(ExecutorBase):
    def __init__(self, config: EngineConfig, source: ModelSource, eos_token_id: int | None) -> None:
        super().__init__(config)
        context = multiprocessing.get_context("spawn")
        init_method = loopback_init_method()
        self._workers: list[_WorkerHandle] = []
        # Stops the workers when the executor is collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        for rank in range(config.parallel.world_size):
            rank_config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, rank=rank))
            parent, child = context.Pipe()
            process = context.Process(target=_worker_main, name=f"VllmWorker-TP{rank}", daemon=True,
                                      args=(child, rank_config, source, eos_token_id, init_method))
            process.start()
            child.close()
            self._workers.append(_WorkerHandle(rank, process, parent))
        logger.info("Started %d worker processes (pids %s)", len(self._workers),
                    [w.process.pid for w in self._workers])
        try:
            self._graph_stats, self.step_time_samples = self._collect()
        except BaseException:
            self.shutdown()
            raise

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        if not self._finalizer.alive:
            raise WorkerDiedError("the executor's workers were stopped")
        for w in self._workers:
            try:
                w.conn.send(step)
            except OSError:
                self._died(w)
        return self._collect()

    def _collect(self):
        """Every rank's reply to the last message; returns rank 0's. Raises a rank's error once
        all have replied (or PEER_ERROR_GRACE_SECONDS after it), WorkerDiedError if one died."""
        pending = {w.conn: w for w in self._workers}
        sentinels = {w.process.sentinel: w for w in self._workers}
        replies: dict[int, object] = {}
        error: BaseException | None = None
        deadline = None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([*pending, *sentinels], timeout)
            if not ready:
                self.shutdown()
                raise WorkerDiedError(f"rank(s) {sorted(w.rank for w in pending.values())} did not "
                                      f"answer within {PEER_ERROR_GRACE_SECONDS} s of another rank's "
                                      f"error ({type(error).__name__}: {error})") from error
            for obj in ready:
                if obj in pending:
                    w = pending.pop(obj)
                    del sentinels[w.process.sentinel]  # it answered: an exit now is its own
                    try:
                        status, value = w.conn.recv()
                    except (EOFError, OSError):
                        self._died(w)
                    if status == "error":
                        error = error or value
                        deadline = deadline or time.monotonic() + PEER_ERROR_GRACE_SECONDS
                    replies[w.rank] = value
                elif obj in sentinels and not sentinels[obj].conn.poll():  # ended without a word
                    self._died(sentinels[obj])
        if error is not None:
            raise error
        return replies[0]

    def _died(self, worker: _WorkerHandle) -> None:
        worker.process.join(1.0)
        code = worker.process.exitcode
        self.shutdown()
        raise WorkerDiedError(f"worker process of TP rank {worker.rank} (pid {worker.process.pid}) "
                              f"died (exit code {code}); the other workers were stopped")

    def shutdown(self) -> None:
        self._finalizer()
