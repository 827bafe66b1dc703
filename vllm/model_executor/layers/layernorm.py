import torch
from torch import nn

from vllm.model_executor.layers import cpu_layer_ops


class RMSNorm(nn.Module):
    """RMS norm with its statistics in float32, cast back before the weight (as Llama does)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        if cpu_layer_ops.usable(x) and self.weight.dtype == x.dtype:
            return cpu_layer_ops.rms_norm(x, self.weight, self.eps)  # same roundings, one pass
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
