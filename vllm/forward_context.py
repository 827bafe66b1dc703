"""The per-step state attention reads from inside a captured graph.

A captured graph is keyed by the shapes of its inputs. The attention metadata (block tables,
masks, sequence offsets) changes shape with every step, so it must not be a graph input:
instead the runner sets it here for the duration of one forward pass, and the attention op
(opaque to the graph) looks it up. The KV caches travel the same way, so the graph never
sees them as inputs it might copy.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from vllm.attention.backends.metadata import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]  # each (num_blocks, block_size, num_kv_heads, head_dim)


@dataclass(frozen=True, slots=True)
class ForwardContext:
    metadata: AttentionMetadata
    kv_caches: list[KVCache]  # one (key, value) pair per layer


_current: ForwardContext | None = None


@contextmanager
def forward_context(context: ForwardContext) -> Iterator[None]:
    """Makes `context` visible to attention for the forward pass run inside the block."""
    global _current
    assert _current is None, "forward contexts do not nest"
    _current = context
    try:
        yield
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside a forward_context(...) block; the model runner "
                           "sets the step's metadata and KV caches there")
    return _current
