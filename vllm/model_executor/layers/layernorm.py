import torch
from torch import nn

from vllm.model_executor.layers import cpu_layer_ops


class RMSNorm(nn.Module):
    """RMS norm with its statistics in float32, cast back before the weight (as Llama does)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        self.c_kernels = False  # set by the CPU attention backend (cpu_layer_ops)
        # (x, weight, eps) -> norm(x): a fused device kernel the platform's backend may install.
        self.fused_kernel = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden) -> norm(x). With `residual` (T, hidden), as in vLLM: the residual stream
        takes x in first, and the result is (norm(residual + x), residual + x); the C path adds
        in place into `residual`, so callers use the returned one."""
        c_path = self.c_kernels and cpu_layer_ops.usable(x) and self.weight.dtype == x.dtype
        if residual is not None:
            if c_path and residual.dtype == x.dtype and residual.is_contiguous():
                return cpu_layer_ops.add_rms_norm(residual, x, self.weight, self.eps), residual
            residual = residual + x
            return self.forward(residual), residual
        if c_path:
            return cpu_layer_ops.rms_norm(x, self.weight, self.eps)  # same roundings, one pass
        if self.fused_kernel is not None:
            return self.fused_kernel(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
