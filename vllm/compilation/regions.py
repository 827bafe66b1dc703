"""Captured regions and the input shapes each was warmed with.

A device graph runtime compiles a region once per distinct input signature (shapes and dtypes
of its tensors, values of its other arguments). `RegionStats` keeps, per region name, the
signatures seen while warming up; once frozen, a call with a signature outside that set is
logged and counted: it means a compile at serving time, which warm-up exists to prevent.
"""

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from vllm.logger import init_logger

logger = init_logger(__name__)


def signature(args: tuple) -> tuple:
    """What a static-shape compiler keys a call on: each tensor's shape, strides and dtype, each
    other value."""
    return tuple((tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


class RegionStats:
    """Signatures per region; after `freeze()`, new ones are counted as unwarmed calls."""

    def __init__(self) -> None:
        self.warmed: dict[str, set[tuple]] = {}
        self.unwarmed: Counter[str] = Counter()
        self.frozen = False

    def record(self, name: str, sig: tuple) -> None:
        seen = self.warmed.setdefault(name, set())
        if sig in seen:
            return
        if not self.frozen:
            seen.add(sig)
            return
        self.unwarmed[name] += 1
        logger.warning("Region %s called with an unwarmed signature %s: it compiles now", name, sig)

    def freeze(self) -> None:
        self.frozen = True

    @property
    def counts(self) -> dict[str, int]:
        """Distinct warmed signatures per region: the graphs compiled for it."""
        return {name: len(sigs) for name, sigs in sorted(self.warmed.items())}


class CapturedRegion:
    """Calls `fn` (a captured module or function) and records the call's signature."""

    def __init__(self, name: str, fn: Callable, stats: RegionStats, key: Any = None) -> None:
        self.name, self.fn, self.stats, self.key = name, fn, stats, key

    def __call__(self, *args: Any) -> Any:
        sig = signature(args)
        self.stats.record(self.name, sig if self.key is None else (self.key, sig))
        return self.fn(*args)
