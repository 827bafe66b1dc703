"""Linear layers split across the tensor-parallel ranks (Megatron's column and row split).

    column-parallel  y = x W^T:  W's output rows split, each rank computes its columns of y
                     (q/k/v heads, gate/up), no communication
    row-parallel     y = x W^T:  W's input columns split, each rank multiplies its slice of x
                     (the column-parallel layer's output) and the ranks' partial sums are
                     all-reduced; the bias is added once, after the sum

A column-parallel layer may hold several checkpoint tensors stacked (q, k and v; gate and up);
each is a `(start, size)` slice of that tensor's output rows, so uneven and replicated head
splits (vllm/distributed/partition.py) are slices like any other. Each rank copies only its
slices in at load time. Both are `Linear`, so their shard is packed for the CPU kernels like a
whole weight.
"""

import torch
from torch import nn

from vllm.distributed import get_tp_group, split_range
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.quantization.gguf_linear import is_quantized


def _check_shape(name: str, got: torch.Size, want: tuple[int, ...]) -> None:
    if tuple(got) != want:
        raise ValueError(f"checkpoint tensor for {name} has shape {tuple(got)}, expected {want}")


class ColumnParallelLinear(Linear):
    """Holds, for each stacked checkpoint tensor i of `full_sizes[i]` output rows, the rows
    `slices[i] = (start, size)`, one after the other."""

    def __init__(self, input_size: int, full_sizes: list[int], slices: list[tuple[int, int]],
                 bias: bool, dtype: torch.dtype) -> None:
        assert len(full_sizes) == len(slices)
        super().__init__(input_size, sum(size for _, size in slices), bias, dtype)
        self.full_sizes = full_sizes
        self.slices = slices
        for param in self.parameters():
            param.weight_loader = self.weight_loader
            param.num_shards = len(slices)

    @classmethod
    def evenly(cls, input_size: int, full_sizes: list[int], bias: bool,
               dtype: torch.dtype) -> "ColumnParallelLinear":
        """Each stacked tensor split over the ranks as evenly as it goes (gate/up, one tensor)."""
        tp = get_tp_group()
        return cls(input_size, full_sizes, [split_range(n, tp.world_size, tp.rank) for n in full_sizes],
                   bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        index = shard or 0
        start, size = self.slices[index]
        offset = sum(s for _, s in self.slices[:index])
        _check_shape(f"shard {index} of a column-parallel layer", loaded.shape[:1],
                     (self.full_sizes[index],))
        dest = param.data.narrow(0, offset, size)
        src = loaded.narrow(0, start, size)
        _check_shape(f"shard {index} of a column-parallel layer", src.shape, tuple(dest.shape))
        dest.copy_(src)


class RowParallelLinear(Linear):
    """Holds the input columns `split_range(input_size, tp, rank)`, or `input_slice` where the
    previous layer's split is not even (attention heads); the output is summed over the ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 input_slice: tuple[int, int] | None = None) -> None:
        tp = get_tp_group()
        self.input_slice = input_slice or split_range(input_size, tp.world_size, tp.rank)
        self.full_input_size = input_size
        super().__init__(self.input_slice[1], output_size, bias, dtype)
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.bias_loader
        self.tp = tp

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        if is_quantized(param):  # rows of GGUF blocks span every input column: one rank only
            assert self.input_slice == (0, self.full_input_size)
            _check_shape("a row-parallel layer", loaded.shape, tuple(param.shape))
            param.data.copy_(loaded)
            return
        _check_shape("a row-parallel layer", loaded.shape, (param.shape[0], self.full_input_size))
        param.data.copy_(loaded.narrow(1, *self.input_slice))

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        _check_shape("a row-parallel bias", loaded.shape, tuple(param.shape))
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, local in) -> (T, out), summed over the ranks."""
        if self.tp.world_size == 1:
            return super().forward(x)
        out = self.tp.all_reduce(self.matmul(x, None))                          # (T, out)
        return out if self.bias is None else out + self.bias
