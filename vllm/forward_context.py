"""The per-step state attention reads from inside a captured graph.

A captured graph is keyed by the shapes of its inputs. The attention metadata changes from step
to step, so it must not be a graph input: instead the runner sets it here for the duration of
one forward pass, together with the backend that reads it, and the attention op (opaque to the
graph) looks both up.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from vllm.attention.backends.abstract import AttentionBackend


@dataclass(frozen=True, slots=True)
class ForwardContext:
    metadata: Any  # the backend's metadata of this step
    backend: AttentionBackend


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
                           "sets the step's metadata and attention backend there")
    return _current
