"""Attention as one opaque op per layer, so a whole forward pass can be captured as one graph.

Inside a captured graph `torch.ops.vllm.attention` is a call the compiler does not trace: it
hands the layer's query/key/value and its KV cache to the attention backend of the current
`forward_context` (the platform's choice), which writes the keys/values to the paged cache and
attends with the step's metadata. Everything else in the model (projections, norms, rotary, the
MLP) depends on the padded token count only. The op declares the cache writes, so a compiler
neither drops nor reorders them; graph splitters cut the model at this op
(vllm/compilation/piecewise.py).
"""

import torch

from vllm.forward_context import get_forward_context


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """query: (T, H, D); key/value: (T, KVH, D) -> (T, H * D)."""
    context = get_forward_context()
    out = context.backend.forward(query, key, value, key_cache, value_cache, context.metadata, scale)
    return out.reshape(query.shape[0], -1)                                  # (T, H * D)


@torch.library.custom_op("vllm::attention", mutates_args=("key_cache", "value_cache"))
def _attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, scale: float) -> torch.Tensor:
    return _attention(query, key, value, key_cache, value_cache, scale)


@_attention_op.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
      value_cache: torch.Tensor, scale: float) -> torch.Tensor:
    return query.new_empty(query.shape[0], query.shape[1] * query.shape[2])


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Writes this step's K/V to the layer's cache and attends; (T, H * D)."""
    if torch.compiler.is_compiling():
        return _attention_op(query, key, value, key_cache, value_cache, scale)
    return _attention(query, key, value, key_cache, value_cache, scale)
