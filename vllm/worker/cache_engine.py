"""Allocates the paged KV cache and sizes it from a memory budget."""

import dataclasses
import math

import torch

from vllm.config import CacheConfig, ModelConfig, ParallelConfig
from vllm.logger import init_logger

logger = init_logger(__name__)


def bytes_per_block(model: ModelConfig, block_size: int, parallel: ParallelConfig) -> int:
    """Keys and values of `block_size` tokens over all layers, on `parallel.rank`."""
    per_token = 2 * model.num_layers * model.get_num_kv_heads(parallel) * model.head_dim * model.dtype.itemsize
    return per_token * block_size


def determine_num_blocks(model: ModelConfig, cache: CacheConfig, parallel: ParallelConfig) -> int:
    """Blocks the cache budget holds. Raises ValueError, with the numbers and the fix, when they
    cannot hold one sequence of max_model_len tokens (checked before any weight is loaded).

    With tensor parallelism the budget is each rank's, and every rank has the same blocks (one
    block manager): they are counted on rank 0, which holds the most KV heads."""
    block_bytes = bytes_per_block(model, cache.block_size, dataclasses.replace(parallel, rank=0))
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
    else:
        num_blocks = cache.kv_cache_memory_bytes // block_bytes
    capacity = num_blocks * cache.block_size
    if capacity < model.max_model_len:
        needed_blocks = -(-model.max_model_len // cache.block_size)
        needed = needed_blocks * block_bytes
        fix = (f"num_gpu_blocks_override to at least {needed_blocks}"
               if cache.num_gpu_blocks_override is not None else
               f"kv_cache_memory_bytes to at least {needed} (VLLM_CPU_KVCACHE_SPACE="
               f"{math.ceil(needed / 1024**3)} GiB)")
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {cache.block_size} "
            f"tokens, {block_bytes / 1024**2:.2f} MiB each in {model.dtype}), fewer than "
            f"max_model_len={model.max_model_len}: one request could never finish. Raise {fix}, "
            f"or lower max_model_len to at most {capacity}.")
    return num_blocks


class CacheEngine:
    """One (key, value) pair of tensors per layer, each (num_blocks + 1, block_size, KVH, D).

    The extra last block is the pad block: padding tokens write there and padded block-table
    entries read from there, so no real block is touched. It starts zeroed and only ever holds
    finite values, so masked-out reads cannot bring NaN into attention.
    """

    def __init__(self, model: ModelConfig, cache: CacheConfig, parallel: ParallelConfig,
                 device: torch.device) -> None:
        self.num_blocks = cache.num_blocks
        self.block_size = cache.block_size
        self.pad_block = self.num_blocks
        # This rank's KV heads (all of them without tensor parallelism).
        shape = (self.num_blocks + 1, cache.block_size, model.get_num_kv_heads(parallel), model.head_dim)
        # Separate tensors, not views of one: a compiled graph that writes a view of a shared
        # base through the attention op must copy the base (functionalization), every layer.
        self.kv_caches = [(torch.zeros(shape, dtype=model.dtype, device=device),
                           torch.zeros(shape, dtype=model.dtype, device=device))
                          for _ in range(model.num_layers)]
        nbytes = sum(k.nbytes + v.nbytes for k, v in self.kv_caches)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s)", self.num_blocks,
                    cache.block_size, nbytes / 1024**3, model.dtype)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies the keys and values of block `src` into block `dst`, in every layer."""
        if not pairs:
            return
        device = self.kv_caches[0][0].device
        src = torch.tensor([p[0] for p in pairs], device=device)
        dst = torch.tensor([p[1] for p in pairs], device=device)
        for cache in (c for pair in self.kv_caches for c in pair):  # (blocks, block_size, KVH, D)
            cache.index_copy_(0, dst, cache.index_select(0, src))

    @property
    def pad_slot(self) -> int:
        return self.pad_block * self.block_size
