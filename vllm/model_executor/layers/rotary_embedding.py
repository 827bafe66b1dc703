"""Rotary position embedding with a precomputed cos/sin table indexed by absolute position."""

import torch
from torch import nn

from vllm.model_executor.layers import cpu_layer_ops


def _inverse_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(head_dim // 2,) float32 inverse frequencies and the cos/sin scale, from the HF config."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta ** exponents), 1.0
    if rope_type in ("dynamic", "longrope"):
        # Their frequencies depend on the sequence length, which a paged cache cannot follow.
        raise ValueError(f"rope_type={rope_type!r} is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type={rope_type!r}")
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scale)


class RotaryEmbedding(nn.Module):
    """Rotates the two halves of each head (Hugging Face's "rotate_half" layout).

    rotate_half(x) = cat(-x2, x1) equals roll(x, D/2) with the first half negated, so the table
    keeps sin with its first half negated and a rotation costs one roll instead of a negation
    and a cat. The products are the same numbers as Hugging Face's, bit for bit.
    """

    def __init__(self, config, head_dim: int, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq, scale = _inverse_frequencies(config, head_dim)
        positions = torch.arange(max_position, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]                    # (P, D/2)
        sin = freqs.sin() * scale                                          # (P, D/2)
        cos = (torch.cat((freqs, freqs), dim=-1).cos() * scale).to(dtype)  # (P, D)
        signed_sin = torch.cat((-sin, sin), dim=-1).to(dtype)             # (P, D)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("signed_sin", signed_sin, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) -> cos, signed_sin: (T, 1, D), looked up once per step for all layers."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                 c_kernels: bool = False) -> torch.Tensor:
    """x: (T, heads, D), queries and keys side by side; cos/signed_sin: (T, 1, D). `c_kernels`:
    the CPU backend's C pass may run (cpu_layer_ops)."""
    if c_kernels and cpu_layer_ops.usable(x) and cos.dtype == x.dtype:
        return cpu_layer_ops.rotary(x, cos, signed_sin)  # same roundings, one pass
    rotated_half = torch.roll(x, x.shape[-1] // 2, dims=-1)               # (x2, x1): signs in the table
    return x * cos + rotated_half * signed_sin
