"""Linear layer with an optional oneDNN-packed weight for decodes and prefill chunks on CPU.

For decode-sized inputs (a few rows) a GEMM is bound by reading the weight; oneDNN reads its
own blocked layout about 1.5x faster than a plain row-major weight on AMX CPUs, and chunk-sized
inputs still gain (SmolLM2's 120 layer GEMMs, bf16, 2-core AMX machine: 1.5 vs 1.2 TFLOP/s at
256 rows, 1.6-2.0 vs 1.6-1.8 at 512). Above PACKED_MAX_ROWS rows the plain GEMM is faster
(2.6 vs 2.45 TFLOP/s at 2048), so both copies are kept.

Up to `cpu_gemv.max_rows()` rows (batch-1 to batch-4 decodes, few sampled rows in the lm_head),
a C GEMV reads the plain weight about 1.4x faster still (cpu_gemv.c). From there up to
`cpu_tile_gemm.max_rows()` rows (batch-32 decodes), an AMX kernel reads a third copy of the
weight, packed in its tiles' layout, ~1.35x faster than oneDNN (cpu_tile_gemm.c).

Inside a captured graph the blocked weight (an opaque MKLDNN tensor) cannot be traced, so
there the layer calls the `vllm::packed_linear` custom op on the plain weight; the op finds the
packed copy of that weight at run time. Keying by the weight's storage, not by the layer, keeps
one graph for all layers that share a shape.
"""

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers import cpu_gemv, cpu_tile_gemm

PACKED_MAX_ROWS = 512

# Storage address of a packed layer's plain weight -> its oneDNN-blocked copy, and its AMX
# tile copy where it has one. Filled by `Linear.pack()`, emptied when the weight is freed.
_PACKED_BY_WEIGHT: dict[int, torch.Tensor] = {}
_TILED_BY_WEIGHT: dict[int, torch.Tensor] = {}


def can_pack(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if 0 < x.shape[0] <= cpu_gemv.max_rows():
        return cpu_gemv.gemv(x, weight, bias)  # decode rows: weight-bandwidth bound
    if x.shape[0] <= cpu_tile_gemm.max_rows():
        tiled = _TILED_BY_WEIGHT.get(weight.data_ptr())
        if tiled is not None:
            return cpu_tile_gemm.gemm(x, tiled, bias)
    packed = _PACKED_BY_WEIGHT.get(weight.data_ptr()) if x.shape[0] <= PACKED_MAX_ROWS else None
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


@torch.library.custom_op("vllm::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: (T, in), weight: (out, in) -> (T, out), on the packed copy of `weight` when it fits."""
    return _linear(x, weight, bias)


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


class Linear(nn.Linear):
    """`nn.Linear` that, after `pack()`, runs small inputs on a oneDNN-blocked weight copy."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed = False
        self.tiled: torch.Tensor | None = None  # the AMX tile copy of the weight, after pack()

    def pack(self) -> None:
        assert can_pack(self.weight.dtype) and self.weight.device.type == "cpu"
        key = self.weight.data_ptr()
        _PACKED_BY_WEIGHT[key] = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
        weakref.finalize(self.weight, _PACKED_BY_WEIGHT.pop, key, None)
        self.tiled = cpu_tile_gemm.pack(self.weight)  # None: no AMX kernel, or the shape does not fit
        if self.tiled is not None:
            _TILED_BY_WEIGHT[key] = self.tiled
            weakref.finalize(self.weight, _TILED_BY_WEIGHT.pop, key, None)
        self.packed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            return packed_linear(x, self.weight, self.bias)
        return _linear(x, self.weight, self.bias)


def pack_linear_weights(model: nn.Module) -> None:
    """Packs every `Linear` of a loaded CPU bf16 model (weights must not change afterwards)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
