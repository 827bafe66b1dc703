"""SiLU-and-multiply, the activation of Llama-family MLPs: silu(gate) * up."""

import torch
import torch.nn.functional as F

from vllm.model_executor.layers import cpu_layer_ops


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (T, 2 I), gate then up -> silu(gate) * up, (T, I). One C pass for bf16 on CPU
    outside a captured graph (cpu_layer_ops), torch's ops elsewhere; both round as torch does."""
    if cpu_layer_ops.usable(gate_up):
        return cpu_layer_ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)                                        # (T, I) each
    return F.silu(gate) * up
