"""Tensor parallelism: the process group of the ranks, collectives, and how weights split."""

from vllm.distributed.parallel_state import (destroy_distributed_environment, get_tp_group,
                                             init_distributed_environment, tensor_model_parallel_all_reduce)
from vllm.distributed.partition import HeadShard, attention_head_shard, split_range

__all__ = ["HeadShard", "attention_head_shard", "destroy_distributed_environment", "get_tp_group",
           "init_distributed_environment", "split_range", "tensor_model_parallel_all_reduce"]
