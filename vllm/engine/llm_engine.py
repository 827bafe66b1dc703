"""The synchronous engine: requests in, one scheduled forward pass per `step()`, outputs out."""

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
from vllm.model_executor.model_loader import load_model, load_tokenizer
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.platforms import get_platform
from vllm.sampling_params import SamplingParams
from vllm.sequence import Sequence, SequenceStatus
from vllm.worker.cache_engine import determine_num_blocks
from vllm.worker.hpu_model_runner import HPUModelRunner

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters over the engine's lifetime."""

    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_mixed_steps: int = 0  # steps that ran decodes and prefill chunks together
    num_preemptions: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer, runner: HPUModelRunner) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.runner = runner
        self.scheduler = Scheduler(config.scheduler, BlockManager(config.cache.num_blocks,
                                                                  config.cache.block_size))
        self.requests: dict[str, Sequence] = {}
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
        runner = HPUModelRunner(config, platform, model)
        runner.warmup()
        return cls(config, tokenizer, runner)

    @property
    def graph_stats(self):
        """Graphs captured at warm-up, compiles since, padding overhead (see GraphStats)."""
        return self.runner.graph_stats

    # ---------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = parse_prompt(prompt, self.tokenizer)
        seq = Sequence(request_id=request_id, prompt=text, prompt_token_ids=token_ids,
                       sampling_params=params,
                       arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        if seq.is_finished:  # refused: it could never run
            seq.metrics.finished_time = time.monotonic()
            self._pending_outputs.append(self._make_output(seq))
            del self.requests[request_id]

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            seq = self.requests.pop(rid, None)
            if seq is not None:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one forward pass; returns the outputs of requests that changed."""
        outputs, self._pending_outputs = self._pending_outputs, []
        step = self.scheduler.schedule()
        if step.is_empty:
            return outputs
        now = time.monotonic()
        sampled = self.runner.execute_model(step)
        self._count(step)
        for scheduled in step.scheduled:
            seq = self.requests[scheduled.request_id]
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
            token = sampled.get(seq.request_id)
            if token is None:
                continue  # a non-final prefill chunk: nothing to report
            self._append_token(seq, token)
            outputs.append(self._make_output(seq))
            if seq.is_finished:
                del self.requests[seq.request_id]
        return outputs

    def _append_token(self, seq: Sequence, token: int) -> None:
        now = time.monotonic()
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        seq.output_token_ids.append(token)
        status = self._stop_status(seq, token)
        detokenize_incrementally(self.tokenizer, seq, final=status is not None)
        if status is not None:
            seq.metrics.finished_time = now
            self.scheduler.finish(seq, status)

    def _stop_status(self, seq: Sequence, token: int) -> SequenceStatus | None:
        params = seq.sampling_params
        if not params.ignore_eos and token == self.eos_token_id:
            return SequenceStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            seq.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        if params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.config.model.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _make_output(self, seq: Sequence) -> RequestOutput:
        completion = CompletionOutput(
            index=0, text=seq.output_text, token_ids=list(seq.output_token_ids),
            finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason)
        return RequestOutput(request_id=seq.request_id, prompt=seq.prompt,
                             prompt_token_ids=seq.prompt_token_ids, outputs=[completion],
                             finished=seq.is_finished, metrics=seq.metrics, error=seq.error)

    def _count(self, step: SchedulerOutput) -> None:
        s = self.stats
        s.num_steps += 1
        s.num_decode_tokens += step.num_decodes
        s.num_prefill_tokens += step.num_prefill_tokens
        s.num_mixed_steps += int(0 < step.num_decodes < len(step.scheduled))
        s.num_preemptions += len(step.preempted_request_ids)
