"""Allocates the paged KV cache and sizes it from a memory budget."""

import logging

import torch

from vllm.config import CacheConfig, ModelConfig

logger = logging.getLogger(__name__)


def bytes_per_block(model: ModelConfig, block_size: int) -> int:
    """Keys and values of `block_size` tokens over all layers."""
    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.dtype.itemsize
    return per_token * block_size


def determine_num_blocks(model: ModelConfig, cache: CacheConfig) -> int:
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
    else:
        num_blocks = cache.kv_cache_memory_bytes // bytes_per_block(model, cache.block_size)
    capacity = num_blocks * cache.block_size
    if capacity < model.max_model_len:
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {cache.block_size}), "
            f"fewer than max_model_len={model.max_model_len}: one request could never finish. "
            "Raise kv_cache_memory_bytes (or VLLM_CPU_KVCACHE_SPACE) or lower max_model_len.")
    return num_blocks


class CacheEngine:
    """One (key, value) pair of tensors per layer, each (num_blocks + 1, block_size, KVH, D).

    The extra last block is the pad block: padding tokens write there and padded block-table
    entries read from there, so no real block is touched. It starts zeroed and only ever holds
    finite values, so masked-out reads cannot bring NaN into attention.
    """

    def __init__(self, model: ModelConfig, cache: CacheConfig, device: torch.device) -> None:
        self.num_blocks = cache.num_blocks
        self.block_size = cache.block_size
        self.pad_block = self.num_blocks
        shape = (model.num_layers, 2, self.num_blocks + 1, cache.block_size, model.num_kv_heads,
                 model.head_dim)
        self._storage = torch.zeros(shape, dtype=model.dtype, device=device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self._storage]
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s)", self.num_blocks,
                    cache.block_size, self._storage.nbytes / 1024**3, model.dtype)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies the keys and values of block `src` into block `dst`, in every layer."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self._storage.device)
        dst = torch.tensor([p[1] for p in pairs], device=self._storage.device)
        # storage: (layers, 2, blocks, block_size, KVH, D); blocks are dimension 2.
        self._storage.index_copy_(2, dst, self._storage.index_select(2, src))

    @property
    def pad_slot(self) -> int:
        return self.pad_block * self.block_size
