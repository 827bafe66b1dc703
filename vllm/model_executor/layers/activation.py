"""SiLU-and-multiply, the activation of Llama-family MLPs: silu(gate) * up."""

import torch
import torch.nn.functional as F

from vllm.model_executor.layers import cpu_layer_ops


def silu_and_mul(gate_up: torch.Tensor, c_kernels: bool = False) -> torch.Tensor:
    """gate_up: (T, 2 I), gate then up -> silu(gate) * up, (T, I). With `c_kernels` (CPU, bf16,
    outside a captured graph) one C pass (cpu_layer_ops), torch's ops elsewhere; both round as
    torch does."""
    if c_kernels and cpu_layer_ops.usable(gate_up):
        return cpu_layer_ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)                                        # (T, I) each
    return F.silu(gate) * up
