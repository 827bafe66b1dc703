"""Which part of a layer each tensor-parallel rank owns (no torch: plain arithmetic, unit-tested).

Attention splits by KV-head groups, so that a rank's query heads attend only to KV heads it holds:

    9 query heads, 3 KV heads, TP=2            4 query heads, 1 KV head, TP=2
    rank 0: KV 0,1  queries 0-5                rank 0: KV 0 (copy)  queries 0,1
    rank 1: KV 2    queries 6-8                rank 1: KV 0 (copy)  queries 2,3

With at least as many KV heads as ranks, the KV heads are split as evenly as they go, the first
ranks taking one more when they do not divide (rank 0 then holds the most: the KV cache is sized
for it, and the same block count serves every rank). With fewer KV heads than ranks, each KV head
is replicated on `tp_size / num_kv_heads` consecutive ranks, which split its query heads evenly;
head counts that do not allow that raise a ValueError.
"""

from dataclasses import dataclass


def split_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of part `index` when `size` items split into `parts` contiguous parts as
    evenly as they go, the first `size % parts` parts one longer."""
    assert 0 <= index < parts
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, base + (index < extra)


@dataclass(frozen=True, slots=True)
class HeadShard:
    """The query heads [q_start, q_start + num_heads) and KV heads [kv_start, kv_start +
    num_kv_heads) one rank holds."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def attention_head_shard(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    """The heads rank `tp_rank` of `tp_size` holds (see the module docstring for the rule)."""
    assert num_heads % num_kv_heads == 0 and 0 <= tp_rank < tp_size
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= tp_size:
        kv_start, kv_count = split_range(num_kv_heads, tp_size, tp_rank)
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    copies = tp_size // num_kv_heads
    if tp_size % num_kv_heads or group % copies:
        raise ValueError(
            f"tensor_parallel_size={tp_size} cannot split {num_heads} attention heads over "
            f"{num_kv_heads} KV heads: with fewer KV heads than ranks, tensor_parallel_size must be a "
            f"multiple of the KV heads, and each KV head's {group} query heads must split evenly over "
            f"its {copies} ranks")
    kv_head = tp_rank // copies
    per_rank = group // copies
    return HeadShard(kv_head * group + (tp_rank % copies) * per_rank, per_rank, kv_head, 1)


def check_tensor_parallel_split(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Raises ValueError when some rank would hold no attention head."""
    if tp_size > num_heads:
        raise ValueError(f"tensor_parallel_size={tp_size} exceeds the model's {num_heads} attention "
                         "heads: some rank would hold none")
    for rank in range(tp_size):
        attention_head_shard(num_heads, num_kv_heads, tp_size, rank)
