"""The interface every attention backend implements; the platform picks the backend.

The model runner describes a step to the backend in plain host values (`StepBatch`: where each
sequence's tokens sit in the flat token dimension, their cached context and block tables) and
gets back the backend's own metadata object, which each attention layer then receives. What the
metadata holds, how it is padded and which kernels read it are the backend's business:

    CPU  vllm/attention/backends/cpu_attn.py   exact shapes; C kernels that read the cache in
                                                place, torch groups elsewhere
    HPU  vllm/attention/backends/hpu_attn.py   every tensor padded to a warmed bucket; attention
                                                in captured regions keyed by few shapes
"""

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vllm.config import EngineConfig


@dataclass(frozen=True, slots=True)
class SeqSpan:
    """Where one sequence's tokens sit in the step: flat offset, query length, cached context;
    and its prompt's length, which tells the prompt's positions from generated ones (None: not
    given, each query keeps the role its span has in the step)."""

    token_offset: int
    query_len: int
    context_len: int
    block_table: list[int]
    num_prompt_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One step's sequences, decodes first, then prefill chunks, flattened and padded.

    `positions` and `slot_mapping` have one entry per token of the padded step (`num_tokens`),
    padding included: padding tokens sit at position 0 and write to the cache's pad slot.
    """

    spans: list[SeqSpan]
    num_decodes: int
    positions: list[int]
    slot_mapping: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.slot_mapping)

    @property
    def num_real_tokens(self) -> int:
        return sum(s.query_len for s in self.spans)


class AttentionBackend(ABC):
    """Builds each step's attention metadata and attends for every layer.

    One instance per model runner. It may also prepare the model once its weights are loaded
    (weight layouts its kernels read, whole-layer kernels) and may claim steps that run best
    outside any captured graph, at their exact size.
    """

    def __init__(self, config: EngineConfig, sliding_window: int | None, device: torch.device) -> None:
        model = config.model
        self.config = config
        self.device = device
        self.dtype = model.dtype
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads = model.get_num_attention_heads(config.parallel)
        self.num_kv_heads = model.get_num_kv_heads(config.parallel)
        self.head_dim = model.head_dim
        self.heads_per_kv = self.num_heads // self.num_kv_heads
        self.sliding_window = sliding_window
        self.block_size = config.cache.block_size
        # The cache's extra last block (vllm/worker/cache_engine.py): padding writes and reads there.
        self.pad_block = config.cache.num_blocks
        self.pad_slot = self.pad_block * self.block_size

    @abstractmethod
    def build_metadata(self, batch: StepBatch) -> Any:
        """The metadata every layer reads for `batch`, on the backend's device."""

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: Any,
                scale: float) -> torch.Tensor:
        """Writes this step's keys/values to the layer's cache and attends.

        query: (T, H, D); key/value: (T, KVH, D); caches: (num_blocks + 1, block_size, KVH, D),
        the last block being the pad block. Returns (T, H, D); rows of padding tokens are finite.
        """

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Called once the weights are loaded, before warm-up; the default does nothing."""

    def runs_eagerly(self, num_decodes: int, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` tokens, the first `num_decodes` of them decodes, runs
        outside the captured graphs at its exact size. The default: never."""
        return False

    def padded_rows(self, n: int, num_tokens: int) -> int:
        """How many rows of logits a step of `num_tokens` tokens that needs `n` (sampled and
        prompt-logprob rows) computes. The default: exactly `n`."""
        return n

    def row_buckets(self, num_tokens: int) -> list[int]:
        """The `padded_rows` a step of `num_tokens` tokens can show, for warm-up. The default:
        none to warm, the rows are not padded."""
        return []

    def padded_copies(self, n: int) -> int:
        """How many block copies a step that forks `n` blocks runs. The default: exactly `n`."""
        return n

    def copy_buckets(self) -> list[int]:
        """The `padded_copies` a step can show, for warm-up. The default: none."""
        return []

    def warmup_regions(self, num_tokens: int, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        """Warms whatever the backend captures on its own at this size beyond what the steps of
        `warmup_metadata` reach, on one layer's caches. The default: nothing."""

    def warmup_metadata(self, num_tokens: int) -> Iterator[Any]:
        """Metadata of padding-only steps of `num_tokens` tokens that together give every shape
        a real step of that size can give. The default: one step with no sequences."""
        yield self.build_metadata(StepBatch(spans=[], num_decodes=0, positions=[0] * num_tokens,
                                            slot_mapping=[self.pad_slot] * num_tokens))
