"""What the double saw: graph captures by key, step boundaries, forbidden ops inside graphs."""

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that cannot live in a captured device graph: they read a value back to the host or give
# an output whose shape depends on the data.
FORBIDDEN = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
             aten.unique_dim.default, aten._unique2.default, aten.unique_consecutive.default,
             aten.repeat_interleave.Tensor, aten.argwhere.default, aten.nonzero_static.default}


def signature(args) -> tuple:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a) for a in args)


def structure(gm: torch.fx.GraphModule) -> str:
    """A graph's ops, blind to node names."""
    text = "|".join(f"{n.op}:{n.target if n.op != 'placeholder' else ''}" for n in gm.graph.nodes)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class _GraphOpsCheck(TorchDispatchMode):
    """Runs inside a captured graph: notes every forbidden op."""

    def __init__(self, recorder: "Recorder", key: tuple) -> None:
        super().__init__()
        self.recorder, self.key = recorder, key

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in FORBIDDEN:
            self.recorder.forbidden.append((self.key, str(func)))
        return func(*args, **(kwargs or {}))


class Recorder:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.graph_keys: set[tuple] = set()  # one per capture/compile a Gaudi would do
        self.captures: list[tuple] = []      # in order, repeats included (dynamo recompiles)
        self.mark_steps = 0
        self.forbidden: list[tuple] = []
        self.depth = 0                       # > 0 while a captured graph runs
        self.on_mark_step: Callable[[], None] | None = None

    def capture(self, key: tuple) -> None:
        self.captures.append(key)
        self.graph_keys.add(key)

    def mark_step(self) -> None:
        self.mark_steps += 1
        if self.on_mark_step is not None:
            self.on_mark_step()

    @contextmanager
    def running(self, key: tuple) -> Iterator[None]:
        self.depth += 1
        try:
            with _GraphOpsCheck(self, key):
                yield
        finally:
            self.depth -= 1


RECORDER = Recorder()
