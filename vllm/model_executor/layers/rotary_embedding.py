"""Rotary position embedding with a precomputed cos/sin table indexed by absolute position."""

import torch
from torch import nn


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
    """Rotates the two halves of each head (Hugging Face's "rotate_half" layout)."""

    def __init__(self, config, head_dim: int, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq, scale = _inverse_frequencies(config, head_dim)
        positions = torch.arange(max_position, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]                    # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)                           # (P, D)
        self.register_buffer("cos", (emb.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) -> cos, sin: (T, 1, D), looked up once per step for all layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (T, H, D); k: (T, KVH, D); cos/sin: (T, 1, D)."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
