"""Attention as one opaque op per layer, so a whole forward pass can be captured as one graph.

Inside a captured graph `torch.ops.vllm.attention` is a call the compiler does not trace: it
writes the layer's keys/values to the paged cache and attends, using the metadata and caches
of the current `forward_context`. Everything else in the model (projections, norms, rotary,
the MLP) depends on the padded token count only, so one graph per token bucket serves every
step, whatever its mix of sequences ("piecewise" capture with a single piece per layer).
"""

import torch

from vllm.attention.backends.hpu_attn import paged_attention, write_to_kv_cache
from vllm.forward_context import get_forward_context


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_index: int,
               scale: float) -> torch.Tensor:
    """query: (T, H, D); key/value: (T, KVH, D) -> (T, H * D)."""
    context = get_forward_context()
    key_cache, value_cache = context.kv_caches[layer_index]
    write_to_kv_cache(key, value, key_cache, value_cache, context.metadata.slot_mapping)
    out = paged_attention(query, key, value, key_cache, value_cache, context.metadata, scale)
    return out.reshape(query.shape[0], -1)                                  # (T, H * D)


# The cache write is a side effect the graph does not see; the op is never dropped or merged
# because each call's output feeds the next layer and its layer_index differs.
@torch.library.custom_op("vllm::attention", mutates_args=())
def _attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_index: int,
                  scale: float) -> torch.Tensor:
    return _attention(query, key, value, layer_index, scale)


@_attention_op.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_index: int,
      scale: float) -> torch.Tensor:
    return query.new_empty(query.shape[0], query.shape[1] * query.shape[2])


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_index: int,
              scale: float) -> torch.Tensor:
    """Writes this step's K/V of layer `layer_index` to its cache and attends; (T, H * D)."""
    if torch.compiler.is_compiling():
        return _attention_op(query, key, value, layer_index, scale)
    return _attention(query, key, value, layer_index, scale)
