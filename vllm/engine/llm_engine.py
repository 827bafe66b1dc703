"""The synchronous engine: requests in, one scheduled forward pass per `step()`, outputs out."""

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from vllm.config import EngineConfig
from vllm.core.block_manager import BlockManager
from vllm.core.scheduler import Scheduler
from vllm.core.scheduler_output import SchedulerOutput
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.detokenizer import detokenize_incrementally
from vllm.inputs import PromptType, parse_prompt
from vllm.logprobs import Logprob
from vllm.model_executor.layers.logprobs import TokenLogprobs
from vllm.model_executor.model_loader import load_model, load_tokenizer
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.platforms import get_platform
from vllm.sampling_params import SamplingParams
from vllm.sequence import Sequence, SequenceGroup, SequenceStatus
from vllm.worker.cache_engine import determine_num_blocks
from vllm.worker.hpu_model_runner import HPUModelRunner
from vllm.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters over the engine's lifetime."""

    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_mixed_steps: int = 0  # steps that ran decodes and prefill chunks together
    num_preemptions: int = 0
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer, runner: HPUModelRunner) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.runner = runner
        # Cached KV is found only by an engine of the same model and dtype.
        cache_key = f"{config.model.model}|{config.model.gguf_file}|{config.model.dtype}".encode()
        block_manager = BlockManager(config.cache.num_blocks, config.cache.block_size,
                                     enable_caching=config.cache.enable_prefix_caching, cache_key=cache_key)
        self.scheduler = Scheduler(config.scheduler, block_manager)
        self.requests: dict[str, SequenceGroup] = {}  # by user request id
        self._seqs: dict[str, tuple[Sequence, SequenceGroup]] = {}  # by sample (scheduler) id
        self._pending_outputs: list[RequestOutput] = []  # requests finished outside a step
        self.stats = EngineStats()
        self.eos_token_id = tokenizer.eos_token_id

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        platform = get_platform(args.device)
        config, source, tokenizer_source = args.create_engine_config(platform)
        start = time.perf_counter()
        tokenizer = load_tokenizer(tokenizer_source)
        model = load_model(source, config.model.hf_config, config.model.dtype,
                           config.model.max_model_len, platform.device)
        logger.info("Loaded %s (%s) in %.1f s", source.display_name, config.model.dtype,
                    time.perf_counter() - start)
        config.cache.num_blocks = determine_num_blocks(config.model, config.cache)
        runner = HPUModelRunner(config, platform, model, eos_token_id=tokenizer.eos_token_id)
        runner.warmup()
        return cls(config, tokenizer, runner)

    @property
    def graph_stats(self):
        """Graphs captured at warm-up, compiles since, padding overhead (see GraphStats)."""
        return self.runner.graph_stats

    # ---------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Queues a request. Raises ValueError, changing nothing, on bad input."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        max_logprobs = self.config.model.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > max_logprobs:
                raise ValueError(f"{name}={value} exceeds max_logprobs={max_logprobs} "
                                 "(an engine argument)")
        text, token_ids = parse_prompt(prompt, self.tokenizer)
        ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        if request_id in self.requests or any(i in self._seqs for i in ids):
            raise ValueError(f"request_id {request_id!r} is already in use")

        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = [Sequence(request_id=sid, prompt=text, prompt_token_ids=token_ids,
                         sampling_params=_sample_params(params, i), arrival_time=arrival, index=i)
                for i, sid in enumerate(ids)]
        seqs[0].pending_forks = seqs[1:]
        group = SequenceGroup(request_id, seqs,
                              prompt_logprobs=None if params.prompt_logprobs is None else [None])
        self.scheduler.add(seqs[0])
        if seqs[0].is_finished:  # refused: it could never run
            for seq in seqs:
                seq.status, seq.error = seqs[0].status, seqs[0].error
                seq.metrics.finished_time = time.monotonic()
            self._pending_outputs.append(self._make_output(group))
            return
        self.requests[request_id] = group
        self._seqs.update((seq.request_id, (seq, group)) for seq in seqs)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stops requests (unknown or finished ids are ignored); their KV blocks are free at once."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
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
        """Schedules and runs one forward pass; returns the outputs of requests that changed."""
        outputs, self._pending_outputs = self._pending_outputs, []
        step = self.scheduler.schedule()
        if step.is_empty and not step.blocks_to_copy:
            return outputs
        now = time.monotonic()
        result = self.runner.execute_model(step)
        self._count(step)
        changed: dict[str, SequenceGroup] = {}
        for scheduled in step.scheduled:
            seq, group = self._seqs[scheduled.request_id]
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
            if scheduled.request_id in result.prompt_logprobs:
                self._add_prompt_logprobs(group, seq, *result.prompt_logprobs[scheduled.request_id])
            if scheduled.request_id not in result.sampled_token_ids:
                continue  # a non-final prefill chunk: nothing to report
            if scheduled.forks:
                self.scheduler.fork(seq)  # the other samples start from this prompt's blocks
            for sid in (scheduled.request_id, *(fork_id for fork_id, _ in scheduled.forks)):
                self._append_token(self._seqs[sid][0], sid, result)
            changed[group.request_id] = group
        for group in changed.values():
            outputs.append(self._make_output(group))
            if group.is_finished:
                self._forget(group)
        return outputs

    def _append_token(self, seq: Sequence, sid: str, result: ModelRunnerOutput) -> None:
        now = time.monotonic()
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        token = result.sampled_token_ids[sid]
        seq.output_token_ids.append(token)
        entry = result.logprobs.get(sid)
        if entry is not None:
            seq.output_logprobs.append(self._logprob_dict(entry))
            seq.cumulative_logprob += entry.logprob
        status = self._stop_status(seq, token)
        new_text = detokenize_incrementally(self.tokenizer, seq, final=status is not None)
        if status is None and self._hit_stop_string(seq, new_text):
            status = SequenceStatus.FINISHED_STOPPED
        if status is not None:
            seq.metrics.finished_time = now
            self.scheduler.finish(seq, status)

    def _stop_status(self, seq: Sequence, token: int) -> SequenceStatus | None:
        params = seq.sampling_params
        num_outputs = len(seq.output_token_ids)
        if num_outputs >= params.min_tokens:
            if not params.ignore_eos and token == self.eos_token_id:
                return SequenceStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_outputs >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.config.model.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _hit_stop_string(self, seq: Sequence, new_text: str) -> bool:
        """Ends the text at the earliest stop string that ends in `new_text` (a stop may span
        several tokens), keeping the stop itself only with `include_stop_str_in_output`."""
        params = seq.sampling_params
        if not params.stop or not new_text or len(seq.output_token_ids) < params.min_tokens:
            return False
        text = seq.output_text
        matches = []
        for stop in params.stop:
            index = text.find(stop, max(0, len(text) - len(new_text) - len(stop) + 1))
            if index != -1:
                matches.append((index, stop))
        if not matches:
            return False
        index, stop = min(matches)
        seq.output_text = text[:index + len(stop) if params.include_stop_str_in_output else index]
        seq.stop_reason = stop
        return True

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
        self.requests.pop(group.request_id, None)
        for seq in group.seqs:
            self._seqs.pop(seq.request_id, None)

    def _count(self, step: SchedulerOutput) -> None:
        s = self.stats
        s.num_steps += 1
        s.num_decode_tokens += step.num_decodes
        s.num_prefill_tokens += step.num_prefill_tokens
        s.num_mixed_steps += int(0 < step.num_decodes < len(step.scheduled))
        s.num_preemptions += len(step.preempted_request_ids)
        s.num_prefix_cache_queries = self.scheduler.num_prefix_cache_queries
        s.num_prefix_cache_hits = self.scheduler.num_prefix_cache_hits


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of an n > 1 request: one sample, its own seed (seed + index, so each
    sample is reproducible on its own), prompt logprobs only once (on sample 0)."""
    if params.n == 1:
        return params
    return dataclasses.replace(
        params, n=1, best_of=None, seed=None if params.seed is None else params.seed + index,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None)
