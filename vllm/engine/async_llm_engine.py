"""The asynchronous engine: many `async for` streams served by one background step loop."""

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from vllm.config import EngineConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.exceptions import EngineDeadError
from vllm.engine.llm_engine import LLMEngine
from vllm.engine.metrics_types import StatLoggerBase
from vllm.inputs import ProcessedPrompt, PromptType
from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams

logger = init_logger(__name__)

# Put in a stream to end it without an output (the request was aborted).
_END_OF_STREAM = None

StreamItem = RequestOutput | BaseException | None


class AsyncEngineDeadError(EngineDeadError):
    """The background loop has stopped on an error; the engine serves no more requests."""


def _new_step_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")


class AsyncLLMEngine:
    """Streams the outputs of concurrent requests; all of them share the steps of one `LLMEngine`.

    One background task (started on first use in the running event loop) runs `engine.step()` on
    the engine's own step thread while any stream is open, and sleeps on `_has_work` when none
    is. Always the same thread, and best the one that loaded the model (`from_engine_args`):
    OpenMP keeps a team of kernel threads for each thread that starts parallel work, and once a
    process holds more of them than it has cores, GNU OpenMP's threads stop spinning at barriers
    and sleep at every one, which makes a batch-1 decode step several times slower on CPU.
    Invariants:
    - A step runs (in its thread) only while the loop holds `_lock`, which it keeps until the
      outputs are in the streams; `generate` and `abort` hold it to add or abort. So adds and
      aborts land between steps, and no two threads ever use the engine at once.
      (A lock rather than a queue of adds applied by the loop: `add_request`'s ValueError then
      reaches the caller as is, and `abort` returns only once the blocks are free.)
    - `_streams` maps every request id whose stream is open to its queue; an id leaves it when its
      finished output is queued, when it is aborted, or when the loop fails.
    - A stream ends after its finished output, after an abort, or with the loop's error.
    A step that fails is the `LLMEngine`'s to handle: it takes the step back, and its requests
    run it again or end with a finished output whose `finish_reason` is "error"; other streams
    go on. Only an error that escapes `step()` (the engine is then dead) ends the loop.
    """

    def __init__(self, engine: LLMEngine, log_requests: bool = False,
                 step_thread: ThreadPoolExecutor | None = None) -> None:
        """`step_thread`: a one-worker executor to run the steps on, best the one that built
        `engine` (as `from_engine_args` does); by default a new one."""
        self.engine = engine
        self.log_requests = log_requests
        self._streams: dict[str, asyncio.Queue[StreamItem]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._has_work: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._dead_error: BaseException | None = None
        # Its one worker lives until the interpreter ends.
        self._step_thread = step_thread or _new_step_thread()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "AsyncLLMEngine":
        """Builds the engine (loads the model, warms it up) on the thread that will run its
        steps: the kernel threads that start then are the ones every step uses."""
        step_thread = _new_step_thread()
        try:
            engine = step_thread.submit(LLMEngine.from_engine_args, engine_args).result()
        except BaseException:
            step_thread.shutdown(wait=False)
            raise
        return cls(engine, log_requests=getattr(engine_args, "enable_log_requests", False),
                   step_thread=step_thread)

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    @property
    def num_unfinished_requests(self) -> int:
        """Requests whose stream is open: not yet finished, aborted or failed."""
        return len(self._streams)

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def get_tokenizer(self):
        return self.engine.tokenizer

    def add_logger(self, name: str, stat_logger: StatLoggerBase) -> None:
        self.engine.add_logger(name, stat_logger)

    def remove_logger(self, name: str) -> None:
        self.engine.remove_logger(name)

    # ---------------------------------------------------------------- requests

    async def generate(self, prompt: PromptType | ProcessedPrompt, sampling_params: SamplingParams,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields the request's cumulative output each time it changes; the last one is finished.

        Bad input raises ValueError here, at the first iteration. A consumer that stops iterating
        or is cancelled aborts the request, which frees its KV blocks. `priority`: see
        `LLMEngine.add_request`.
        """
        queue = await self._add_request(request_id, prompt, sampling_params, priority)
        try:
            while True:
                item = await queue.get()
                if item is _END_OF_STREAM:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if self._streams.get(request_id) is queue:  # still open: the consumer left early
                # Shielded: the abort must happen even if the consumer is cancelled again at
                # this await (as under anyio's cancel scopes, which a server's disconnect uses).
                await asyncio.shield(self.abort(request_id))

    async def abort(self, request_id: str) -> None:
        """Aborts the request between steps: its KV blocks are free when this returns."""
        if self._lock is None or self._loop is not asyncio.get_running_loop():
            return  # the loop never ran here, so nothing of ours is in the engine
        async with self._lock:
            queue = self._streams.pop(request_id, None)
            if queue is None:
                return  # finished or aborted already
            self.engine.abort_request(request_id)
            while not queue.empty():  # outputs not yet consumed are stale: end the stream now
                queue.get_nowait()
            queue.put_nowait(_END_OF_STREAM)

    async def _add_request(self, request_id: str, prompt: PromptType | ProcessedPrompt,
                           params: SamplingParams, priority: int) -> asyncio.Queue[StreamItem]:
        self._check_alive()
        self._start_loop()
        async with self._lock:
            self._check_alive()  # again: the loop may have died while we waited
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self.engine.add_request(request_id, prompt, params, priority=priority)  # ValueError on bad input
            if self.log_requests:
                logger.info("Added request %s: %s", request_id, params)
            queue: asyncio.Queue[StreamItem] = asyncio.Queue()
            self._streams[request_id] = queue
        self._has_work.set()
        return queue

    async def do_log_stats(self) -> None:
        """Hands the engine's stat loggers its state now, between two steps."""
        if self._lock is None or self._loop is not asyncio.get_running_loop():
            self.engine.do_log_stats()  # no loop of ours: no step is running
            return
        async with self._lock:
            self.engine.do_log_stats()

    # ---------------------------------------------------------------- the loop

    def _check_alive(self) -> None:
        if self._dead_error is not None:
            raise AsyncEngineDeadError("the engine loop has died") from self._dead_error

    def _start_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # asyncio objects belong to one event loop: a new loop (another asyncio.run) gets its
            # own. Streams left by the old one have no consumer any more.
            if self._streams:
                self.engine.abort_request(list(self._streams))
                self._streams.clear()
            self._loop, self._task = loop, None
            self._lock, self._has_work = asyncio.Lock(), asyncio.Event()
        if self._task is None or self._task.done():
            self._stopping = False
            self._task = loop.create_task(self._run_loop(), name="AsyncLLMEngine loop")

    async def _run_loop(self) -> None:
        try:
            while not self._stopping:
                if not self._streams:
                    self._has_work.clear()
                    await self._has_work.wait()
                    continue
                async with self._lock:
                    outputs = await self._step_in_thread()
                    self._dispatch(outputs)
                await asyncio.sleep(0)  # let consumers, adds and aborts run between steps
        except Exception as error:
            logger.exception("AsyncLLMEngine: a step failed; failing %d stream(s)", len(self._streams))
            self._dead_error = error
            self._fail_all(error)

    async def _step_in_thread(self) -> list[RequestOutput]:
        # The step is blocking CPU work: its thread keeps the event loop responsive.
        future = asyncio.get_running_loop().run_in_executor(self._step_thread, self.engine.step)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # A thread cannot be interrupted: hold the lock until the step is over.
            await asyncio.wait([future])
            raise

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is None:
                continue  # not one of our streams (the LLMEngine may be shared)
            queue.put_nowait(out)
            if out.finished:
                del self._streams[out.request_id]
        if self._streams and not outputs and not self.engine.has_unfinished_requests():
            stuck = sorted(self._streams)
            raise RuntimeError(f"the engine went idle with streams {stuck[:5]} unfinished")

    def _fail_all(self, error: BaseException) -> None:
        """Ends every open stream with `error` and aborts its request."""
        ids = list(self._streams)
        for queue in self._streams.values():
            queue.put_nowait(error)
        self._streams.clear()
        try:
            self.engine.abort_request(ids)
        except Exception:
            logger.exception("AsyncLLMEngine: aborting %d request(s) failed", len(ids))

    async def shutdown(self) -> None:
        """Stops the loop after its current step; open streams end with AsyncEngineDeadError."""
        if not self.is_running or self._loop is not asyncio.get_running_loop():
            return
        self._stopping = True
        self._has_work.set()
        await self._task
        async with self._lock:
            if self._streams:
                self._fail_all(AsyncEngineDeadError("the engine was shut down"))
