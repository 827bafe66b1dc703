"""Tensor parallelism: the process group of the ranks, collectives, and how weights split."""

from vllm.distributed.parallel_state import (CollectiveTimes, destroy_distributed_environment, get_tp_group,
                                             init_distributed_environment, tensor_model_parallel_all_reduce,
                                             timing_collectives)
from vllm.distributed.partition import HeadShard, attention_head_shard, split_range

__all__ = ["CollectiveTimes", "HeadShard", "attention_head_shard", "destroy_distributed_environment",
           "get_tp_group", "init_distributed_environment", "split_range", "tensor_model_parallel_all_reduce",
           "timing_collectives"]
