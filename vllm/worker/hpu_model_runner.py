"""Turns a `SchedulerOutput` into one forward pass over a flattened batch, and samples.

The step's sequences are packed back to back into one (num_tokens,) dimension, decodes first:

    input_ids   [ d0 | d1 | p0 p0 p0 p0 | p1 p1 ]
    positions   [ 17 | 5  | 0  1  2  3  | 8  9  ]   (p1 is a later chunk: 8 tokens cached)
    slot_mapping: the cache slot each token's K/V is written to
    logits rows: the last token of every sequence whose chunk reaches its end
"""

import logging
from dataclasses import dataclass

import torch

from vllm.attention.backends.hpu_attn import AttentionMetadata, SeqSpan, build_attention_metadata
from vllm.config import EngineConfig
from vllm.core.scheduler_output import SchedulerOutput
from vllm.model_executor.layers.linear import can_pack, pack_linear_weights
from vllm.model_executor.layers.sampler import sample
from vllm.platforms import Platform
from vllm.worker.cache_engine import CacheEngine

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor       # (num_tokens,) int64
    positions: torch.Tensor       # (num_tokens,) int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # (num_sampling_seqs,) int64: rows of the hidden states to sample


class HPUModelRunner:
    """Owns the model, the KV cache and the per-request random generators."""

    def __init__(self, config: EngineConfig, platform: Platform, model: torch.nn.Module) -> None:
        self.config = config
        self.platform = platform
        self.device = platform.device
        self.model = model
        if platform.device_type == "cpu" and can_pack(config.model.dtype):
            pack_linear_weights(model)
        self.cache = CacheEngine(config.model, config.cache, self.device)
        hf = config.model.hf_config
        self.heads_per_kv = hf.num_attention_heads // config.model.num_kv_heads
        self.sliding_window = getattr(model, "sliding_window", None)
        self._default_generator = torch.Generator().manual_seed(config.model.seed)
        self._generators: dict[str, torch.Generator] = {}

    # ---------------------------------------------------------------- inputs

    def prepare_inputs(self, step: SchedulerOutput) -> ModelInputs:
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
        metadata = build_attention_metadata(
            spans, step.num_decodes, slots, block_size, self.heads_per_kv, self.sliding_window,
            self.cache.pad_block, self.device)
        return ModelInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            metadata=metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
        )

    # ---------------------------------------------------------------- the step

    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput) -> dict[str, int]:
        """Runs the step; returns the sampled token of each request whose chunk reached its end."""
        for request_id in step.finished_request_ids:
            self._generators.pop(request_id, None)
        inputs = self.prepare_inputs(step)
        hidden = self.model(inputs.input_ids, inputs.positions, self.cache.kv_caches,
                            inputs.metadata)                                # (T, hidden)
        sampling = [s for s in step.scheduled if s.sample]
        if not sampling:
            return {}
        logits = self.model.compute_logits(hidden[inputs.logits_indices])   # (S, vocab) fp32
        tokens = sample(logits.cpu(), [s.sampling_params for s in sampling],
                        [self._generator(s.request_id, s.sampling_params.seed) for s in sampling])
        return {s.request_id: t for s, t in zip(sampling, tokens, strict=True)}

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator:
        if seed is None:
            return self._default_generator
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator().manual_seed(seed)
        return gen
