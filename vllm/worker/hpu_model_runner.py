"""Turns a `SchedulerOutput` into one forward pass over a flattened batch, and samples.

The step's sequences are packed back to back into one (num_tokens,) dimension, decodes first,
then padded up to the token bucket whose graphs were captured at warm-up:

    input_ids   [ d0 | d1 | p0 p0 p0 p0 | p1 p1 | 0  0 ]
    positions   [ 17 | 5  | 0  1  2  3  | 8  9  | 0  0 ]   (p1 is a later chunk: 8 tokens cached)
    slot_mapping: the cache slot each token's K/V goes to; padding -> the pad block
    logits rows: the last token of every sequence whose chunk reaches its end
"""

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._dynamo.utils import counters as dynamo_counters

from vllm.attention.backends.abstract import SeqSpan, StepBatch
from vllm.config import EngineConfig
from vllm.core.block_manager import kv_slots
from vllm.core.scheduler_output import SchedulerOutput
from vllm.forward_context import ForwardContext, forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.logprobs import compute_logprobs
from vllm.model_executor.layers.sampler import sample_with_processors
from vllm.platforms import Platform
from vllm.worker.bucketing import bucket_config_from_env, find_bucket, generate_buckets
from vllm.worker.cache_engine import CacheEngine
from vllm.worker.graph_stats import GraphStats
from vllm.worker.runner_output import ModelRunnerOutput
from vllm.worker.step_checks import check_step

logger = init_logger(__name__)


def _compiled_graph_count() -> int:
    return dynamo_counters["stats"]["unique_graphs"]


def _mark_token_count_dynamic(input_ids: torch.Tensor, positions: torch.Tensor) -> None:
    """Asks the compile of the largest bucket to cover all of them, as far as it can: dynamo
    still specializes sizes 0 and 1, so a bucket of size 1 gets a graph of its own."""
    # A hint, not a constraint: with a hard range, a compile cached on disk under another
    # range would be rejected instead of recompiled.
    for t in (input_ids, positions):
        torch._dynamo.maybe_mark_dynamic(t, 0)


class LogitsHead(nn.Module):
    """The rows of the step's hidden states that are sampled or scored, through the lm_head
    (this rank's slice of the vocabulary)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """hidden: (T, hidden), rows: (R,) int64 -> (R, vocab) float32."""
        return self.model.compute_logits(hidden.index_select(0, rows))


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # (padded_tokens,) int64
    positions: torch.Tensor  # (padded_tokens,) int64
    metadata: Any            # the attention backend's
    # Hidden-state rows to take logits of: first the last token of every sampling sequence (in
    # step order), then every prompt-logprob row; padded by the backend (`padded_rows`).
    logits_rows: torch.Tensor
    num_sampled: int         # of the rows, how many sample
    num_rows: int            # real rows before padding


class HPUModelRunner:
    """Owns the model, the KV cache, the attention backend, the captured graphs and the
    per-request random generators. Asks the platform's attention backend for everything that
    depends on the device."""

    def __init__(self, config: EngineConfig, platform: Platform, model: torch.nn.Module,
                 eos_token_id: int | None = None) -> None:
        self.config = config
        self.eos_token_id = eos_token_id  # masked while a request is below its min_tokens
        self.platform = platform
        self.device = platform.device
        self.model = model
        self.cache = CacheEngine(config.model, config.cache, config.parallel, self.device)
        model.bind_kv_caches(self.cache.kv_caches)
        buckets = []
        if not config.enforce_eager:
            buckets = generate_buckets(
                bucket_config_from_env(config.scheduler.max_num_batched_tokens, platform.min_token_bucket))
        self.attn_backend = platform.attention_backend(config, getattr(model, "sliding_window", None))
        self.attn_backend.prepare_model(model)
        self._default_generator = torch.Generator().manual_seed(config.model.seed)
        self._generators: dict[str, torch.Generator] = {}

        self.graph_stats = GraphStats(enabled=not config.enforce_eager, buckets=buckets,
                                      region_stats=platform.region_stats)
        self._logits = LogitsHead(model)
        if self.graph_stats.enabled:
            from torch._dynamo import config as dynamo_config

            # A captured function keeps up to one graph per bucket, and the cache is per function
            # for the whole process (engines of other models add theirs); past the limit dynamo
            # would quietly run eager.
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 8 * len(buckets))
            # The whole forward pass; attention inside it is an opaque op that reads the step's
            # metadata from the forward context (vllm/attention/layer.py).
            self._compiled_model = platform.capture_model(model)
            self._logits = platform.capture_region("logits", self._logits)
        self._warmed_up = False

    # ---------------------------------------------------------------- warm-up

    @torch.inference_mode()
    def warmup(self) -> None:
        """Runs every bucket, largest first, with every shape the attention backend and the
        per-step row tensors can take at that size, so that no step compiles later.

        With a symbolic token count (CPU) the first bucket compiles the one graph that the others
        reuse; otherwise each bucket captures its own.
        """
        if not self.graph_stats.enabled or self._warmed_up:
            return
        start = time.perf_counter()
        before = _compiled_graph_count()
        backend = self.attn_backend
        for size in reversed(self.graph_stats.buckets):
            # Two tensors: the same one twice would be captured as aliased inputs.
            ids = torch.zeros(size, dtype=torch.int64, device=self.device)
            positions = torch.zeros(size, dtype=torch.int64, device=self.device)
            if self.platform.symbolic_token_count and size == self.graph_stats.buckets[-1]:
                _mark_token_count_dynamic(ids, positions)
            for metadata in backend.warmup_metadata(size):
                with forward_context(ForwardContext(metadata, backend)):
                    hidden = self._compiled_model(ids, positions)                   # (size, hidden)
                self.platform.mark_step()
            backend.warmup_regions(size, *self.cache.kv_caches[0])
            for num_rows in backend.row_buckets(size):
                self._logits(hidden, torch.zeros(num_rows, dtype=torch.int64, device=self.device))
                self.platform.mark_step()
            self.platform.synchronize()
        for num_copies in backend.copy_buckets():
            self._copy_blocks([(self.cache.pad_block, self.cache.pad_block)] * num_copies)
        self.platform.region_stats.freeze()
        stats = self.graph_stats
        stats.dynamo_graphs_at_warmup = _compiled_graph_count() - before
        stats.device_graphs = self.platform.region_stats.counts
        stats.warmup_seconds = time.perf_counter() - start
        self._warmed_up = True
        logger.info("Warm-up compiled %d graphs %s for %d token buckets %s in %.1f s",
                    stats.graphs_compiled_at_warmup, stats.device_graphs or "", len(stats.buckets), stats.buckets,
                    stats.warmup_seconds)

    @property
    def token_buckets(self) -> list[int]:
        """The token counts steps are padded to (the warmed buckets); empty when steps run at
        their own size (eager)."""
        return list(self.graph_stats.buckets)

    @torch.inference_mode()
    def time_token_sizes(self, repeats: int = 2) -> list[tuple[int, float]]:
        """(tokens, seconds) of a padding-only forward pass at each size a step runs at: the
        warmed buckets, or without graphs the sizes the buckets would have. The fastest of
        `repeats` runs after an untimed one; what the step-time model starts from."""
        sizes = self.token_buckets or generate_buckets(bucket_config_from_env(
            self.config.scheduler.max_num_batched_tokens, self.platform.min_token_bucket))
        model = self._compiled_model if self.graph_stats.enabled else self.model
        backend = self.attn_backend
        samples = []
        for size in sizes:
            ids = torch.zeros(size, dtype=torch.int64, device=self.device)
            positions = torch.zeros(size, dtype=torch.int64, device=self.device)
            metadata = next(iter(backend.warmup_metadata(size)))
            times = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                with forward_context(ForwardContext(metadata, backend)):
                    model(ids, positions)                                            # (size, hidden)
                self.platform.mark_step()
                self.platform.synchronize()
                times.append(time.perf_counter() - start)
            samples.append((size, min(times[1:])))
        return samples

    # ---------------------------------------------------------------- inputs

    def prepare_inputs(self, step: SchedulerOutput, padded_size: int) -> ModelInputs:
        block_size = self.cache.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[SeqSpan] = []
        sampled: list[int] = []
        scored: list[int] = []  # prompt-logprob rows
        for s in step.scheduled:
            offset = len(input_ids)
            input_ids.extend(s.token_ids)
            chunk = range(s.start_position, s.start_position + s.num_tokens)
            positions.extend(chunk)
            slots.extend(kv_slots(s.block_table, chunk, block_size))
            spans.append(SeqSpan(offset, s.num_tokens, s.context_len, s.block_table, len(s.prompt_token_ids)))
            if s.sample:
                sampled.append(offset + s.num_tokens - 1)
            if s.prompt_logprob_targets:
                first = offset + s.prompt_logprobs_start - s.start_position
                scored.extend(range(first, first + len(s.prompt_logprob_targets)))
        num_pad = padded_size - len(input_ids)
        assert num_pad >= 0
        input_ids.extend([0] * num_pad)
        positions.extend([0] * num_pad)
        slots.extend([self.cache.pad_slot] * num_pad)
        metadata = self.attn_backend.build_metadata(StepBatch(spans, step.num_decodes, positions, slots))
        rows = sampled + scored
        padded_rows = self.attn_backend.padded_rows(len(rows), padded_size) if rows else 0
        return ModelInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            metadata=metadata,
            logits_rows=torch.tensor(rows + [0] * (padded_rows - len(rows)), dtype=torch.int64,
                                     device=self.device),
            num_sampled=len(sampled),
            num_rows=len(rows),
        )

    def _padded_size(self, num_tokens: int) -> int | None:
        """The bucket for this step, or None to run it eagerly at its own size."""
        if not self.graph_stats.enabled:
            return None
        bucket = find_bucket(self.graph_stats.buckets, num_tokens)
        if bucket is None:
            self.graph_stats.unwarmed_steps += 1
            logger.warning("Step of %d tokens exceeds the largest bucket (%d); running it eagerly",
                           num_tokens, self.graph_stats.buckets[-1])
        return bucket

    # ---------------------------------------------------------------- the step

    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput, eager: bool = False) -> ModelRunnerOutput:
        """Runs the step (without the captured graphs if `eager`); samples for each request whose
        chunk reached its end (and its forks)."""
        check_step(step, self.cache.num_blocks, self.cache.block_size)
        for request_id in step.finished_request_ids:
            self._generators.pop(request_id, None)
        # Before any KV write of this step: forked samples take their copy of the last block.
        self._copy_blocks(step.blocks_to_copy)
        if step.is_empty:
            return ModelRunnerOutput()
        num_tokens = step.num_batched_tokens
        if eager or self.attn_backend.runs_eagerly(step.num_decodes, num_tokens):
            self.graph_stats.eager_steps += 1
            bucket = None
        else:
            bucket = self._padded_size(num_tokens)
        inputs = self.prepare_inputs(step, bucket or num_tokens)
        if bucket is not None:
            self.graph_stats.real_tokens += num_tokens
            self.graph_stats.padded_tokens += bucket - num_tokens
        start = time.perf_counter()
        hidden = self._forward(inputs, eager=bucket is None)                        # (T, hidden)
        output = ModelRunnerOutput()
        if not inputs.num_rows:
            output.forward_seconds = time.perf_counter() - start
            return output
        logits = self._logits(hidden, inputs.logits_rows)                      # (R, vocab shard) fp32
        self.platform.mark_step()
        # Tensor parallelism: each rank holds a slice of the vocabulary; only rank 0 samples.
        logits = self.model.gather_logits(logits)                                    # (R, vocab)
        if logits is None:
            return output
        logits = logits.cpu()[:inputs.num_rows]  # sliced on the host: no shape from the step
        output.forward_seconds = time.perf_counter() - start
        # A step that fails is run again (LLMEngine.step): seeded samples must draw the same.
        sampled = [rid for s in step.scheduled if s.sample for rid in (s.request_id, *(f for f, _ in s.forks))]
        states = {rid: self._generators[rid].get_state() for rid in sampled if rid in self._generators}
        try:
            if inputs.num_sampled:
                self._sample(step, logits[:inputs.num_sampled], output)
            if inputs.num_rows > inputs.num_sampled:
                self._prompt_logprobs(step, logits[inputs.num_sampled:], output)
        except BaseException:
            for rid in sampled:
                if rid in states:
                    self._generators[rid].set_state(states[rid])
                else:
                    self._generators.pop(rid, None)  # made in this step: starts from its seed again
            raise
        return output

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        pad = self.cache.pad_block
        self.cache.copy_blocks(pairs + [(pad, pad)] * (self.attn_backend.padded_copies(len(pairs)) - len(pairs)))
        self.platform.mark_step()

    def _sample(self, step: SchedulerOutput, logits: torch.Tensor, output: ModelRunnerOutput) -> None:
        """logits: (S, vocab) float32 on the host, the last token of each sampling sequence, in
        step order."""
        rows, ids, params, prompts, outs = [], [], [], [], []
        for row, s in enumerate(x for x in step.scheduled if x.sample):
            # Forked samples draw from their parent's row: one prompt, n next tokens.
            for request_id, p in ((s.request_id, s.sampling_params), *s.forks):
                rows.append(row)
                ids.append(request_id)
                params.append(p)
                prompts.append(s.prompt_token_ids)
                outs.append(s.output_token_ids if request_id == s.request_id else [])
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows)]                                # (R, vocab)
        generators = [self._generator(rid, p.seed) for rid, p in zip(ids, params, strict=True)]
        # The processors never modify `logits`, which logprobs read afterwards.
        masks = [step.token_masks.get(rid) for rid in ids] if step.token_masks else None
        tokens = sample_with_processors(logits, params, generators, prompts, outs, self.eos_token_id, masks)
        output.sampled_token_ids.update(zip(ids, tokens, strict=True))
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            index = torch.tensor(wanted)
            entries = compute_logprobs(logits[index], [tokens[i] for i in wanted],
                                       [params[i].logprobs for i in wanted])
            output.logprobs.update((ids[i], e) for i, e in zip(wanted, entries, strict=True))

    def _prompt_logprobs(self, step: SchedulerOutput, logits: torch.Tensor,
                         output: ModelRunnerOutput) -> None:
        """logits: (L, vocab) float32 on the host, the prompt-logprob rows of the step's
        sequences, in step order (see prepare_inputs)."""
        row = 0
        for s in step.scheduled:
            targets = s.prompt_logprob_targets
            if targets:
                entries = compute_logprobs(logits[row:row + len(targets)], list(targets),
                                           [s.sampling_params.prompt_logprobs] * len(targets))
                output.prompt_logprobs[s.request_id] = (s.prompt_logprobs_start, entries)
                row += len(targets)

    def _forward(self, inputs: ModelInputs, eager: bool) -> torch.Tensor:
        captured = self.graph_stats.enabled and not eager
        before = _compiled_graph_count()
        with forward_context(ForwardContext(inputs.metadata, self.attn_backend)):
            if captured:
                # After warm-up every step is padded to a captured bucket, so only the guards
                # that tell the buckets apart (the token count) need to run, not the hundreds
                # on parameters.
                skip = self._warmed_up and self.platform.skip_guards_after_warmup
                with torch.compiler.set_stance(skip_guard_eval_unsafe=skip):
                    hidden = self._compiled_model(inputs.input_ids, inputs.positions)  # (T, hidden)
            else:
                hidden = self.model(inputs.input_ids, inputs.positions)              # (T, hidden)
        self.platform.mark_step()  # HPU lazy mode: flush the step's ops; no-op elsewhere
        if captured and self._warmed_up and _compiled_graph_count() != before:
            self.graph_stats.dynamo_compiles_after_warmup += _compiled_graph_count() - before
            logger.warning("A graph was compiled after warm-up (%d tokens)", inputs.input_ids.shape[0])
        return hidden

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator:
        if seed is None:
            return self._default_generator
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator().manual_seed(seed)
        return gen
