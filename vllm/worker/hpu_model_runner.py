"""Turns a `SchedulerOutput` into one forward pass over a flattened batch, and samples.

The step's sequences are packed back to back into one (num_tokens,) dimension, decodes first,
then padded up to the token bucket whose graphs were captured at warm-up:

    input_ids   [ d0 | d1 | p0 p0 p0 p0 | p1 p1 | 0  0 ]
    positions   [ 17 | 5  | 0  1  2  3  | 8  9  | 0  0 ]   (p1 is a later chunk: 8 tokens cached)
    slot_mapping: the cache slot each token's K/V goes to; padding -> the pad block
    logits rows: the last token of every sequence whose chunk reaches its end
"""

import logging
import time
from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters as dynamo_counters

from vllm.attention.backends.metadata import AttentionMetadata, SeqSpan, build_attention_metadata
from vllm.attention.ops import cpu_paged_decode, cpu_paged_prefill
from vllm.config import EngineConfig
from vllm.core.scheduler_output import SchedulerOutput
from vllm.forward_context import ForwardContext, forward_context
from vllm.model_executor.layers.linear import can_pack, pack_linear_weights
from vllm.model_executor.layers.logprobs import compute_logprobs
from vllm.model_executor.layers.sampler import sample_with_processors
from vllm.platforms import Platform
from vllm.worker.bucketing import bucket_config_from_env, find_bucket, generate_buckets
from vllm.worker.cache_engine import CacheEngine
from vllm.worker.graph_stats import GraphStats
from vllm.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger(__name__)


def _compiled_graph_count() -> int:
    return dynamo_counters["stats"]["unique_graphs"]


def _mark_token_count_dynamic(input_ids: torch.Tensor, positions: torch.Tensor) -> None:
    """Asks the compile of the largest bucket to cover all of them, as far as it can: dynamo
    still specializes sizes 0 and 1, so a bucket of size 1 gets a graph of its own."""
    # A hint, not a constraint: with a hard range, a compile cached on disk under another
    # range would be rejected instead of recompiled.
    for t in (input_ids, positions):
        torch._dynamo.maybe_mark_dynamic(t, 0)


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor       # (padded_tokens,) int64
    positions: torch.Tensor       # (padded_tokens,) int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # (num_sampling_seqs,) int64: rows of the hidden states to sample


class HPUModelRunner:
    """Owns the model, the KV cache, the captured graphs and the per-request random generators."""

    def __init__(self, config: EngineConfig, platform: Platform, model: torch.nn.Module,
                 eos_token_id: int | None = None) -> None:
        self.config = config
        self.eos_token_id = eos_token_id  # masked while a request is below its min_tokens
        self.platform = platform
        self.device = platform.device
        self.model = model
        if platform.device_type == "cpu" and can_pack(config.model.dtype):
            pack_linear_weights(model)
        self.cache = CacheEngine(config.model, config.cache, self.device)
        num_heads = config.model.hf_config.num_attention_heads
        self.heads_per_kv = num_heads // config.model.num_kv_heads
        # CPU: decodes and prefill chunks read their keys in place through C kernels, when they
        # build here (the prefill one needs AMX, bf16 and head_dim 64).
        self.paged_decode = cpu_paged_decode.is_available(self.device, config.model.dtype, num_heads,
                                                          config.model.num_kv_heads, config.model.head_dim)
        self.paged_prefill = cpu_paged_prefill.is_available(
            self.device, config.model.dtype, num_heads, config.model.num_kv_heads, config.model.head_dim,
            config.cache.block_size)
        self.sliding_window = getattr(model, "sliding_window", None)
        # CPU bf16: eager steps whose attention the C kernels take run each layer as one C call.
        # Steps of only decodes do so in graph mode too (nothing for a graph to remove); their
        # metadata must carry the decodes for the paged kernel.
        self.fused_layers = None  # llama_cpu_layers.FusedLayers
        if self.paged_decode and hasattr(model, "enable_fused_layers"):
            self.fused_layers = model.enable_fused_layers()
        self._default_generator = torch.Generator().manual_seed(config.model.seed)
        self._generators: dict[str, torch.Generator] = {}

        self.graph_stats = GraphStats(enabled=not config.enforce_eager)
        if self.graph_stats.enabled:
            self.graph_stats.buckets = generate_buckets(
                bucket_config_from_env(config.scheduler.max_num_batched_tokens, platform.min_token_bucket))
            from torch._dynamo import config as dynamo_config

            # A captured function keeps up to one graph per bucket, and the cache is per function
            # for the whole process (engines of other models add theirs); past the limit dynamo
            # would quietly run eager.
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 8 * len(self.graph_stats.buckets))
            # The whole forward pass is one graph; attention inside it is an opaque op that reads
            # the step's metadata from the forward context (vllm/attention/layer.py).
            self._compiled_model = platform.compile_fn()(model)
        self._warmed_up = False

    # ---------------------------------------------------------------- warm-up

    @torch.inference_mode()
    def warmup(self) -> None:
        """Runs every bucket, largest first, so that no step compiles later.

        With a symbolic token count (CPU) the first bucket compiles the one graph that the others
        reuse; otherwise each bucket captures its own.
        """
        if not self.graph_stats.enabled or self._warmed_up:
            return
        start = time.perf_counter()
        before = _compiled_graph_count()
        pad_slot = self.cache.pad_slot
        for size in reversed(self.graph_stats.buckets):
            # Padding only: attention has no sequence to attend for, the graph sees the shapes.
            metadata = build_attention_metadata([], 0, [pad_slot] * size, self.cache.block_size,
                                                self.heads_per_kv, self.sliding_window,
                                                self.cache.pad_block, self.device)
            # Two tensors: the same one twice would be captured as aliased inputs.
            ids = torch.zeros(size, dtype=torch.int64, device=self.device)
            positions = torch.zeros(size, dtype=torch.int64, device=self.device)
            if self.platform.symbolic_token_count and size == self.graph_stats.buckets[-1]:
                _mark_token_count_dynamic(ids, positions)
            with forward_context(ForwardContext(metadata, self.cache.kv_caches)):
                self._compiled_model(ids, positions)
            self.platform.synchronize()
        stats = self.graph_stats
        stats.graphs_compiled_at_warmup = _compiled_graph_count() - before
        stats.warmup_seconds = time.perf_counter() - start
        self._warmed_up = True
        logger.info("Warm-up compiled %d graphs for %d token buckets %s in %.1f s",
                    stats.graphs_compiled_at_warmup, len(self.graph_stats.buckets), self.graph_stats.buckets,
                    stats.warmup_seconds)

    # ---------------------------------------------------------------- inputs

    def prepare_inputs(self, step: SchedulerOutput, padded_size: int) -> ModelInputs:
        block_size = self.cache.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[SeqSpan] = []
        logits_indices: list[int] = []
        for s in step.scheduled:
            offset = len(input_ids)
            input_ids.extend(s.token_ids)
            table = s.block_table
            for pos in range(s.start_position, s.start_position + s.num_tokens):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            spans.append(SeqSpan(offset, s.num_tokens, s.context_len, table))
            if s.sample:
                logits_indices.append(offset + s.num_tokens - 1)
        num_pad = padded_size - len(input_ids)
        assert num_pad >= 0
        input_ids.extend([0] * num_pad)
        positions.extend([0] * num_pad)
        slots.extend([self.cache.pad_slot] * num_pad)
        metadata = build_attention_metadata(
            spans, step.num_decodes, slots, block_size, self.heads_per_kv, self.sliding_window,
            self.cache.pad_block, self.device, self.config.model.dtype,
            split_prefill=self.device.type == "cpu", paged_decode=self.paged_decode,
            paged_prefill=self.paged_prefill)
        return ModelInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            metadata=metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
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
    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Runs the step; samples for each request whose chunk reached its end (and its forks)."""
        for request_id in step.finished_request_ids:
            self._generators.pop(request_id, None)
        # Before any KV write of this step: forked samples take their copy of the last block.
        self.cache.copy_blocks(step.blocks_to_copy)
        if step.is_empty:
            return ModelRunnerOutput()
        num_tokens = step.num_batched_tokens
        if self.fused_layers is not None and step.num_decodes == num_tokens <= self.fused_layers.max_tokens:
            self.graph_stats.fused_decode_steps += 1
            bucket = None  # one C call per layer, unpadded (LlamaModel.forward)
        else:
            bucket = self._padded_size(num_tokens)
        inputs = self.prepare_inputs(step, bucket or num_tokens)
        if bucket is not None:
            self.graph_stats.real_tokens += num_tokens
            self.graph_stats.padded_tokens += bucket - num_tokens
        hidden = self._forward(inputs, eager=bucket is None)
        output = ModelRunnerOutput()
        if any(s.sample for s in step.scheduled):
            self._sample(step, hidden[inputs.logits_indices], output)
        if any(s.prompt_logprob_targets for s in step.scheduled):
            self._prompt_logprobs(step, hidden, output)
        return output

    def _sample(self, step: SchedulerOutput, hidden: torch.Tensor, output: ModelRunnerOutput) -> None:
        """hidden: (S, hidden), the last token of each sampling sequence, in step order."""
        logits = self.model.compute_logits(hidden).cpu()                       # (S, vocab) fp32
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
        tokens = sample_with_processors(logits, params, generators, prompts, outs, self.eos_token_id)
        output.sampled_token_ids.update(zip(ids, tokens, strict=True))
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            index = torch.tensor(wanted)
            entries = compute_logprobs(logits[index], [tokens[i] for i in wanted],
                                       [params[i].logprobs for i in wanted])
            output.logprobs.update((ids[i], e) for i, e in zip(wanted, entries, strict=True))

    def _prompt_logprobs(self, step: SchedulerOutput, hidden: torch.Tensor,
                         output: ModelRunnerOutput) -> None:
        """hidden: (T, hidden), every token of the step."""
        offset = 0
        for s in step.scheduled:
            targets = s.prompt_logprob_targets
            if targets:
                row = offset + s.prompt_logprobs_start - s.start_position
                logits = self.model.compute_logits(hidden[row:row + len(targets)])    # (L, V)
                entries = compute_logprobs(logits, list(targets),
                                           [s.sampling_params.prompt_logprobs] * len(targets))
                output.prompt_logprobs[s.request_id] = (s.prompt_logprobs_start, entries)
            offset += s.num_tokens

    def _forward(self, inputs: ModelInputs, eager: bool) -> torch.Tensor:
        captured = self.graph_stats.enabled and not eager
        before = _compiled_graph_count()
        with forward_context(ForwardContext(inputs.metadata, self.cache.kv_caches)):
            if captured:
                # After warm-up every step is padded to a captured bucket, so only the guards
                # that tell the buckets apart (the token count) need to run, not the hundreds
                # on parameters.
                with torch.compiler.set_stance(skip_guard_eval_unsafe=self._warmed_up):
                    hidden = self._compiled_model(inputs.input_ids, inputs.positions)  # (T, hidden)
            else:
                hidden = self.model(inputs.input_ids, inputs.positions)              # (T, hidden)
        self.platform.mark_step()  # HPU lazy mode: flush the step's ops; no-op elsewhere
        if captured and self._warmed_up and _compiled_graph_count() != before:
            self.graph_stats.compiles_after_warmup += _compiled_graph_count() - before
            logger.warning("A graph was compiled after warm-up (%d tokens)", inputs.input_ids.shape[0])
        return hidden

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator:
        if seed is None:
            return self._default_generator
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator().manual_seed(seed)
        return gen
