"""The static-shape audit of the HPU path, on the test double (tests/hpu_double).

What Gaudi compiles, and so what must not change after warm-up:

    lazy mode      every lazy graph: the ops, with their input shapes and dtypes, run between two
                   `mark_step`s outside captured graphs (`SegmentAudit`), and every HPU graph
                   captured (`RECORDER.graph_keys`: module and input signature)
    compile mode   every `hpu_backend` compile (`RECORDER.captures`: graph structure and input
                   signature; dynamo recompiles a region for each new signature)

In both, no op inside a captured graph may read a value back to the host or give a shape that
depends on data (`RECORDER.forbidden`). Host-side work (building metadata, sampling) is not
device work and is not audited: the audit wraps only the model, the logits head and the block
copies.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _describe(x) -> object:
    return (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else None


class SegmentAudit(TorchDispatchMode):
    """Collects the signature of every lazy-mode graph a forward pass builds."""

    def __init__(self, recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.segments: set[tuple] = set()
        self._current: list[tuple] = []
        recorder.on_mark_step = self.close

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.recorder.depth == 0:  # inside an HPU graph, the graph's own key covers it
            self._current.append((str(func), tuple(_describe(a) for a in tree_leaves((args, kwargs)))))
        return func(*args, **(kwargs or {}))

    def close(self) -> None:
        if self._current:
            self.segments.add(tuple(self._current))
            self._current = []

    def audited(self, fn: Callable) -> Callable:
        """`fn` run with the audit on; ops left after its last mark_step end a segment too."""
        def run(*args, **kwargs):
            with self:
                out = fn(*args, **kwargs)
            self.close()
            return out
        return run


@dataclass
class Snapshot:
    graph_keys: set = field(default_factory=set)
    num_captures: int = 0
    segments: set = field(default_factory=set)


def snapshot(recorder, audit: SegmentAudit | None) -> Snapshot:
    return Snapshot(set(recorder.graph_keys), len(recorder.captures),
                    set(audit.segments) if audit is not None else set())


def new_since(before: Snapshot, recorder, audit: SegmentAudit | None) -> dict[str, list]:
    """What Gaudi would have compiled after `before`, by kind (empty lists: nothing)."""
    return {
        "graphs": sorted(map(str, recorder.graph_keys - before.graph_keys)),
        "compiles": [str(k) for k in recorder.captures[before.num_captures:]],
        "lazy_segments": [] if audit is None else [s[:3] for s in audit.segments - before.segments],
        "forbidden_ops": list(recorder.forbidden),
    }
