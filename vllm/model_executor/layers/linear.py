"""Linear layer with an optional oneDNN-packed weight for small batches on CPU."""

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many rows the packed bf16 GEMM wins (about 1.5-2x for decode-sized batches on
# AMX CPUs); above it the plain GEMM is as fast or faster, so both weights are kept.
PACKED_MAX_ROWS = 64


def can_pack(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


class Linear(nn.Linear):
    """`nn.Linear` that, after `pack()`, runs inputs of at most PACKED_MAX_ROWS rows on a copy of
    its weight reordered into oneDNN's blocked layout."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self._packed: torch.Tensor | None = None

    def pack(self) -> None:
        assert can_pack(self.weight.dtype) and self.weight.device.type == "cpu"
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        if self._packed is not None and x.shape[0] <= PACKED_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack_linear_weights(model: nn.Module) -> None:
    """Packs every `Linear` of a loaded CPU bf16 model (weights must not change afterwards)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
