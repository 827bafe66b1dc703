"""The synchronous engine: requests in, one scheduled forward pass per `step()`, outputs out."""

import contextlib
import dataclasses
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from vllm.config import EngineConfig
from vllm.core.block_manager import BlockManager
from vllm.core.scheduler import Scheduler
from vllm.core.scheduler_output import SchedulerOutput
from vllm.core.step_time_model import StepShape, StepTimeModel
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.exceptions import EngineDeadError
from vllm.engine.interrupts import deferred_interrupts
from vllm.engine.metrics_types import IterationStats, StatLoggerBase, Stats
from vllm.engine.stop_checker import StopChecker
from vllm.engine.structured_output import StructuredOutputManager
from vllm.executor import ExecutorBase, WorkerDiedError, get_executor_class
from vllm.inputs import ProcessedPrompt, PromptType, parse_prompt, truncated
from vllm.logger import init_logger
from vllm.logprobs import Logprob
from vllm.model_executor.layers.logprobs import TokenLogprobs
from vllm.model_executor.model_loader import load_tokenizer
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.platforms import get_platform
from vllm.sampling_params import SamplingParams
from vllm.sequence import Sequence, SequenceGroup, SequenceStatus
from vllm.worker.cache_engine import determine_num_blocks
from vllm.worker.runner_output import ModelRunnerOutput

logger = init_logger(__name__)


@dataclass
class EngineStats:
    """Counters over the engine's lifetime."""

    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_mixed_steps: int = 0  # steps that ran decodes and prefill chunks together
    num_preemptions: int = 0
    num_failed_steps: int = 0  # steps whose forward pass or sampling raised (taken back)
    # Prompt tokens looked up in the prefix cache, and of those the tokens found there.
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    # Wall time of the steps in the model (ModelRunnerOutput.forward_seconds); the rest of a
    # step's time is the host's: scheduling, inputs, sampling, outputs.
    model_forward_seconds: float = 0.0


class LLMEngine:
    """Requests in, one scheduled forward pass per `step()`, outputs out.

    A step happens or it does not. If its forward pass or sampling raises, the scheduler takes it
    back (`Scheduler.undo`) and its requests run it again; a request that was in
    `MAX_FAILED_STEPS` failed steps finishes instead, with `finish_reason="error"` and the error
    in `RequestOutput.error`. The log says which requests took which way. A KeyboardInterrupt
    during the forward pass takes the step back too, then propagates; elsewhere in the step it
    waits for the engine's state to be whole. Any other failure leaves that state unknown, and a
    worker of the executor that dies takes the model with it: the engine is then dead and raises
    `EngineDeadError`, now and on every later call.
    """

    # Failed steps a request may be in; the last one finishes it with the error.
    MAX_FAILED_STEPS = 2

    def __init__(self, config: EngineConfig, tokenizer, model_executor: ExecutorBase) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_executor = model_executor
        # Cached KV is found only by an engine of the same model and dtype.
        cache_key = f"{config.model.model}|{config.model.gguf_file}|{config.model.dtype}".encode()
        block_manager = BlockManager(config.cache.num_blocks, config.cache.block_size,
                                     enable_caching=config.cache.enable_prefix_caching, cache_key=cache_key)
        self.scheduler = Scheduler(config.scheduler, block_manager)
        self.requests: dict[str, SequenceGroup] = {}  # by user request id
        self._seqs: dict[str, tuple[Sequence, SequenceGroup]] = {}  # by sample (scheduler) id
        self._pending_outputs: list[RequestOutput] = []  # for the caller of the next step()
        self.stats = EngineStats()
        self.eos_token_id = tokenizer.eos_token_id
        stop_ids = sorted({self.eos_token_id, *config.model.eos_token_ids} - {None})
        self.structured_output = StructuredOutputManager(tokenizer, config.model.vocab_size, stop_ids)
        self._stop_checker = StopChecker(tokenizer, self.structured_output)
        self._dead_error: BaseException | None = None
        # Stat loggers (the server's log line and Prometheus); none offline, where stats cost nothing.
        self.stat_loggers: dict[str, StatLoggerBase] = {}
        self._iteration = IterationStats()
        self._logged_stats = EngineStats()  # the counters when the loggers last saw them
        # When the last step's outputs were in, while requests remained: the gaps of the next
        # step's decodes start there (see `_observe_step_time`).
        self._last_outputs_time: float | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, executor_class: type[ExecutorBase] | None = None
                         ) -> "LLMEngine":
        """The engine `args` describe; `executor_class` replaces the one the parallel config
        picks (one that measures its ranks, say)."""
        if args.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={args.data_parallel_size} runs replicas of the engine "
                             "behind the server: use `vllm serve --data-parallel-size N`; one "
                             "LLMEngine (and LLM(...)) is one replica, data_parallel_size=1")
        platform = get_platform(args.device)
        config, source, tokenizer_source = args.create_engine_config(platform)
        # Before the weights load: a cache that cannot hold one sequence fails at once.
        config.cache.num_blocks = determine_num_blocks(config.model, config.cache, config.parallel)
        tokenizer = load_tokenizer(tokenizer_source)
        executor_class = executor_class or get_executor_class(config.parallel)
        model_executor = executor_class(config, source, tokenizer.eos_token_id)
        engine = cls(config, tokenizer, model_executor)
        if config.scheduler.max_step_latency_ms is not None:
            engine.start_step_time_model()
        return engine

    def start_step_time_model(self) -> None:
        """Fits the model that sizes steps under `max_step_latency_ms` on the padding-only steps
        the workers timed after warm-up; measured steps refine it from then on."""
        samples = self.model_executor.step_time_samples
        model = StepTimeModel(tail_limit_seconds=self.config.scheduler.max_step_latency_ms / 1000)
        model.fit_warmup([(StepShape(tokens), seconds) for tokens, seconds in samples])
        self.scheduler.step_time_model = model
        self.scheduler.token_buckets = list(self.model_executor.graph_stats.buckets)
        logger.info("Step-time model for max_step_latency_ms=%s fitted on %d token sizes: "
                    "%.2f ms + %.4f ms/token", self.config.scheduler.max_step_latency_ms, len(samples),
                    1e3 * model.coefficients[0], 1e3 * model.coefficients[1])

    @property
    def runner(self):
        """The model runner, where it runs in this process (distributed_executor_backend="uni")."""
        return self.model_executor.runner

    @property
    def graph_stats(self):
        """Graphs captured at warm-up, compiles since, padding overhead (see GraphStats)."""
        return self.model_executor.graph_stats

    def shutdown(self) -> None:
        """Stops the executor's workers (none to stop in one process); idempotent."""
        self.model_executor.shutdown()

    # ---------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt: PromptType | ProcessedPrompt, params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queues a request. Raises ValueError, changing nothing, on bad input. A prompt
        already checked by `process_prompt` is not tokenized again. `priority` (lower first)
        needs the priority scheduling policy."""
        self._check_alive()
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        self.config.scheduler.check_priority(priority)
        self.validate_sampling_params(params)
        prompt = truncated(parse_prompt(prompt, self.tokenizer), params.truncate_prompt_tokens,
                           self.config.model.max_model_len)
        if set(self.config.model.eos_token_ids) - {self.eos_token_id} or params.bad_words:
            params = params.clone()
            # The generation config's other EOS ids stop it too.
            params.update_from_generation_config(self.config.model.generation_config_fields,
                                                 self.eos_token_id)
            params.update_from_tokenizer(self.tokenizer)
        _check_something_is_allowed(params, self.eos_token_id)
        grammar = None
        if params.structured_outputs is not None:
            if params.min_tokens:
                raise ValueError("min_tokens cannot be combined with structured_outputs: the grammar decides "
                                 "where the output may end")
            grammar = self.structured_output.compile(params.structured_outputs)
        ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        if request_id in self.requests or any(i in self._seqs for i in ids):
            raise ValueError(f"request_id {request_id!r} is already in use")

        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = [Sequence(request_id=sid, prompt=prompt.text, prompt_token_ids=prompt.token_ids,
                         sampling_params=_sample_params(params, i), arrival_time=arrival,
                         eos_token_id=self.eos_token_id, priority=priority, cache_salt=prompt.cache_salt, index=i)
                for i, sid in enumerate(ids)]
        seqs[0].pending_forks = seqs[1:]
        group = SequenceGroup(request_id, seqs,
                              prompt_logprobs=None if params.prompt_logprobs is None else [None])
        with self._guard():
            self.scheduler.add(seqs[0])
            if seqs[0].is_finished:  # refused: it could never run
                for seq in seqs:
                    seq.status, seq.error = seqs[0].status, seqs[0].error
                    seq.metrics.finished_time = time.monotonic()
                self._pending_outputs.append(self._make_output(group))
                if self.stat_loggers:
                    self._iteration.record_finished(group)
                return
            self.requests[request_id] = group
            self._seqs.update((seq.request_id, (seq, group)) for seq in seqs)
            if grammar is not None:
                for seq in seqs:
                    self.structured_output.add(seq.request_id, grammar)

    def process_prompt(self, prompt: PromptType | ProcessedPrompt) -> ProcessedPrompt:
        """Checks and tokenizes a prompt for `add_request`; raises ValueError on a malformed one."""
        return parse_prompt(prompt, self.tokenizer)

    def validate_sampling_params(self, params: SamplingParams) -> None:
        """Raises ValueError if this engine cannot serve `params` (SamplingParams checks the rest
        itself)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        max_logprobs = self.config.model.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > max_logprobs:
                raise ValueError(f"{name}={value} exceeds max_logprobs={max_logprobs} "
                                 "(an engine argument)")
        vocab = self.config.model.vocab_size
        for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids)):
            bad = sorted(t for t in set(ids or ()) if t >= vocab)
            if bad:
                raise ValueError(f"{name} holds ids outside the model's vocabulary [0, {vocab}): {bad[:5]}")

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stops requests (unknown or finished ids are ignored); their KV blocks are free at once,
        and outputs of theirs not yet returned by `step()` are dropped. A no-op on a dead engine."""
        if self._dead_error is not None:
            return
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        with self._guard():
            self._pending_outputs = [o for o in self._pending_outputs if o.request_id not in ids]
            for rid in ids:
                group = self.requests.get(rid)
                if group is None:
                    continue
                for seq in group.seqs:
                    if not seq.is_finished:
                        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                self._forget(group)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; False (nothing done) while requests hold blocks."""
        return self.scheduler.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one forward pass; returns the outputs of requests that changed
        (see the class docstring for what happens when it fails)."""
        self._check_alive()
        step, result, committed = None, None, False
        start = time.perf_counter()
        try:
            with self._guard():
                step = self.scheduler.schedule()
                step.token_masks = self.structured_output.masks(step)
            # From here the step counts as computed: until its outputs are in, an escape takes it back.
            if not step.is_empty or step.blocks_to_copy:
                result = self.model_executor.execute_model(step)
            with self._guard():
                committed = True
                if result is not None:
                    self._process(step, result)
                    self._observe_step_time(step, start)
        except BaseException as error:
            if step is None or committed:
                raise
            if isinstance(error, WorkerDiedError):  # the model is gone with it: nothing to retry on
                self._dead_error = error
                logger.error("The engine is dead: %s", error)
                raise EngineDeadError(f"the engine is dead: {error}") from error
            with self._guard():
                self.scheduler.undo(step)
                if isinstance(error, Exception):
                    self._fail_step(step, error)
            if not isinstance(error, Exception):
                logger.warning("Step interrupted (%s); its %d request(s) will run it again",
                               type(error).__name__, len(step.scheduled))
                raise
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.stat_loggers:
            self.do_log_stats()
        return outputs

    def _process(self, step: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Hands the step's sampled tokens to the scheduler and records what the requests
        need beyond them (times, logprobs, text); queues the outputs of those that changed."""
        now = time.monotonic()
        self._count(step)
        self.stats.model_forward_seconds += result.forward_seconds
        changed: dict[str, SequenceGroup] = {}
        for scheduled in step.scheduled:
            seq, group = self._seqs[scheduled.request_id]
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
            if scheduled.request_id in result.prompt_logprobs:
                self._add_prompt_logprobs(group, seq, *result.prompt_logprobs[scheduled.request_id])
            if scheduled.request_id in result.sampled_token_ids:
                changed[group.request_id] = group
        for seq in self.scheduler.update_from_output(step, result.sampled_token_ids, self._stop_checker):
            self._record_token(seq, result.logprobs.get(seq.request_id), now)
        for group in changed.values():
            self._pending_outputs.append(self._make_output(group))
            if group.is_finished:
                self._forget(group)

    def _observe_step_time(self, step: SchedulerOutput, start: float) -> None:
        """A step's wall time refines the step-time model: from `start` (its schedule) to its
        outputs, or for a step with decodes from the previous step's outputs, when each decode
        got its previous token, to its own: the gap the target bounds, with what runs between
        steps (the server's streaming of the outputs, requests added)."""
        now = time.perf_counter()
        since = self._last_outputs_time
        self._last_outputs_time = now if self.has_unfinished_requests() else None
        model = self.scheduler.step_time_model
        if model is None or step.is_empty:
            return
        seconds = now - (since if step.num_decodes and since is not None else start)
        model.observe(self.scheduler.step_shape(step), seconds)
        if self.stat_loggers:
            self._iteration.record_step_time(step, seconds)

    def _fail_step(self, step: SchedulerOutput, error: Exception) -> None:
        """After `step` was taken back: its requests run it again, except those in their
        MAX_FAILED_STEPS-th failed step, which finish with the error."""
        self.stats.num_failed_steps += 1
        retried: dict[str, SequenceGroup] = {}
        failed: dict[str, SequenceGroup] = {}
        for scheduled in step.scheduled:
            seq, group = self._seqs[scheduled.request_id]
            seq.num_failed_steps += 1
            if seq.num_failed_steps >= self.MAX_FAILED_STEPS:
                failed[group.request_id] = group
            else:
                retried[group.request_id] = group
        reason = f"{type(error).__name__}: {error}"
        now = time.monotonic()
        for group in failed.values():
            retried.pop(group.request_id, None)
            for seq in group.seqs:
                seq.error = f"{self.MAX_FAILED_STEPS} steps with this request failed, the last with {reason}"
                if not seq.is_finished:
                    seq.metrics.finished_time = now
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
            self._pending_outputs.append(self._make_output(group))
            self._forget(group)
        logger.error("A step failed (%s); taken back. Requests that run it again: %s; requests "
                     "finished with the error: %s", reason, sorted(retried) or "none",
                     sorted(failed) or "none", exc_info=error)

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Around every change of the engine's state: Ctrl-C waits for the block's end, and an
        exception, which leaves that state unknown, makes the engine dead."""
        with deferred_interrupts():
            try:
                yield
            except Exception as error:
                self._dead_error = error
                logger.exception("The engine's state is unknown after this error; it is now dead")
                raise EngineDeadError(f"the engine is dead after {type(error).__name__}: {error}") from error

    def _check_alive(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(f"the engine died earlier of {type(self._dead_error).__name__}: "
                                  f"{self._dead_error}") from self._dead_error

    @property
    def is_dead(self) -> bool:
        return self._dead_error is not None

    def _record_token(self, seq: Sequence, logprobs: TokenLogprobs | None, now: float) -> None:
        """The times and logprobs of the token the scheduler just appended to `seq`."""
        if self.stat_loggers:
            self._iteration.record_token(seq, now)
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        seq.metrics.last_token_time = now
        if logprobs is not None:
            seq.output_logprobs.append(self._logprob_dict(logprobs))
            seq.cumulative_logprob += logprobs.logprob
        if seq.is_finished:
            seq.metrics.finished_time = now

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        """The top alternatives in rank order, then the chosen token if it is not among them."""
        ids = [*entry.top_token_ids, entry.token_id]
        texts = self.tokenizer.batch_decode([[t] for t in ids])
        out = {t: Logprob(lp, rank, text) for rank, (t, lp, text)
               in enumerate(zip(entry.top_token_ids, entry.top_logprobs, texts), start=1)}
        if entry.token_id not in out:
            out[entry.token_id] = Logprob(entry.logprob, entry.rank, texts[-1])
        return out

    def _add_prompt_logprobs(self, group: SequenceGroup, seq: Sequence, first: int,
                             entries: list[TokenLogprobs]) -> None:
        """Appends the entries for prompt tokens first + 1, first + 2, ... (the scheduler hands
        out each position once, in order)."""
        assert group.prompt_logprobs is not None and seq is group.first
        assert len(group.prompt_logprobs) == first + 1
        group.prompt_logprobs.extend(self._logprob_dict(entry) for entry in entries)

    def _make_output(self, group: SequenceGroup) -> RequestOutput:
        first = group.first
        wants_logprobs = first.sampling_params.logprobs is not None
        completions = [CompletionOutput(
            index=seq.index, text=seq.output_text, token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
            logprobs=list(seq.output_logprobs) if wants_logprobs else None,
            finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason)
            for seq in group.seqs]
        prompt_logprobs = None if group.prompt_logprobs is None else list(group.prompt_logprobs)
        return RequestOutput(request_id=group.request_id, prompt=first.prompt,
                             prompt_token_ids=first.prompt_token_ids, outputs=completions,
                             finished=group.is_finished, prompt_logprobs=prompt_logprobs,
                             metrics=first.metrics, error=first.error,
                             num_cached_tokens=first.num_cached_tokens or 0)

    def _forget(self, group: SequenceGroup) -> None:
        """The request leaves the engine (finished or aborted)."""
        if self.requests.pop(group.request_id, None) is not None and self.stat_loggers:
            self._iteration.record_finished(group)
        for seq in group.seqs:
            self._seqs.pop(seq.request_id, None)
            self.structured_output.remove(seq.request_id)

    def _count(self, step: SchedulerOutput) -> None:
        s = self.stats
        s.num_steps += 1
        s.num_decode_tokens += step.num_decodes
        s.num_prefill_tokens += step.num_prefill_tokens
        s.num_mixed_steps += int(0 < step.num_decodes < len(step.scheduled))
        s.num_preemptions += len(step.preempted_request_ids)
        s.num_prefix_cache_queries = self.scheduler.num_prefix_cache_queries
        s.num_prefix_cache_hits = self.scheduler.num_prefix_cache_hits
        if self.stat_loggers:
            self._iteration.record_step(step)

    # ---------------------------------------------------------------- stats for the loggers

    def add_logger(self, name: str, stat_logger: StatLoggerBase) -> None:
        if name in self.stat_loggers:
            raise KeyError(f"a stat logger named {name!r} is already attached")
        self.stat_loggers[name] = stat_logger

    def remove_logger(self, name: str) -> None:
        del self.stat_loggers[name]

    def do_log_stats(self) -> None:
        """Hands every logger the state now and what happened since the previous call."""
        if not self.stat_loggers:
            return
        scheduler, bm, last = self.scheduler, self.scheduler.block_manager, self._logged_stats
        running_groups = {self._seqs[seq.request_id][1].request_id for seq in scheduler.running
                          if seq.request_id in self._seqs}
        stats = Stats(
            now=time.monotonic(), num_running=len(running_groups), num_waiting=len(scheduler.waiting),
            kv_cache_usage=1.0 - bm.num_free_blocks / bm.num_blocks,
            num_steps=self.stats.num_steps - last.num_steps,
            num_mixed_steps=self.stats.num_mixed_steps - last.num_mixed_steps,
            num_preemptions=self.stats.num_preemptions - last.num_preemptions,
            num_prefix_cache_queries=self.stats.num_prefix_cache_queries - last.num_prefix_cache_queries,
            num_prefix_cache_hits=self.stats.num_prefix_cache_hits - last.num_prefix_cache_hits,
            iteration=self._iteration)
        self._iteration = IterationStats()
        self._logged_stats = dataclasses.replace(self.stats)
        for stat_logger in self.stat_loggers.values():
            stat_logger.log(stats)


def _check_something_is_allowed(params: SamplingParams, eos_token_id: int | None) -> None:
    """Raises ValueError when `allowed_token_ids` could leave a step with no token to sample:
    when every allowed id is the last token of a bad word or, with `min_tokens`, an id that
    min_tokens holds back. The other processors never remove every token; a grammar may, beside
    allowed ids or bad words, and the request then ends with an error (`StopChecker`)."""
    if params.allowed_token_ids is None:
        return
    banned = {ids[-1] for ids in params.bad_words_token_ids}
    if params.min_tokens > 0:
        banned |= set(params.stop_token_ids) | ({eos_token_id} - {None})
    if set(params.allowed_token_ids) <= banned:
        raise ValueError("allowed_token_ids leaves nothing to sample: each of its ids ends a bad word or, "
                         "with min_tokens, is an EOS or stop token id")


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of an n > 1 request: one sample, its own seed (seed + index, so each
    sample is reproducible on its own), prompt logprobs only once (on sample 0)."""
    if params.n == 1:
        return params
    return dataclasses.replace(
        params, n=1, best_of=None, seed=None if params.seed is None else params.seed + index,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None)
