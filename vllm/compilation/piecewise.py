"""A dynamo backend that captures the model piece by piece, cut at every attention call.

The model's graph is split before and after each `vllm::attention` op (vllm/attention/layer.py),
as vLLM's piecewise capture does. The pieces in between (norms, projections, rotary, the MLP)
depend on the padded token count only; each is handed to the device's own backend and recorded
as a region keyed by its structure and input shapes, so the pieces of all middle layers count as
one graph per token bucket. The attention calls run as they are: the attention backend captures
its own regions, keyed by the attention metadata's buckets.
"""

import hashlib
from collections.abc import Callable

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from vllm.compilation.regions import CapturedRegion, RegionStats

DeviceBackend = Callable[[fx.GraphModule, list], Callable]


def _is_attention(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and getattr(target, "name", lambda: "")().startswith("vllm::attention")


def _structure(gm: fx.GraphModule) -> str:
    """A digest of a piece's ops, blind to node names (which carry the layer index)."""
    text = "|".join(f"{n.op}:{n.target if n.op != 'placeholder' else ''}:{len(n.args)}" for n in gm.graph.nodes)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _Piece(nn.Module):
    """One piece: compiled by the device backend on its first call, recorded on every call."""

    def __init__(self, gm: fx.GraphModule, device_backend: DeviceBackend, stats: RegionStats) -> None:
        super().__init__()
        self.gm = gm
        self._device_backend = device_backend
        self._compiled: Callable | None = None
        self._region = CapturedRegion("body", self._run, stats, key=_structure(gm))

    def _run(self, *args):
        if self._compiled is None:
            self._compiled = self._device_backend(self.gm, list(args))
        return self._compiled(*args)

    def forward(self, *args):
        return self._region(*args)


class PiecewiseBackend:
    """`torch.compile(model, backend=PiecewiseBackend(device_backend, stats), dynamic=False)`."""

    def __init__(self, device_backend: DeviceBackend, stats: RegionStats) -> None:
        self.device_backend = device_backend
        self.stats = stats

    def __call__(self, gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
        partition = 0
        owner: dict[fx.Node, int] = {}
        for node in gm.graph.nodes:
            if _is_attention(node):
                partition += 1
                owner[node] = partition
                partition += 1
            else:
                owner[node] = partition
        split = split_module(gm, None, lambda node: owner[node], keep_original_order=True)
        for name, child in list(split.named_children()):
            if not any(_is_attention(n) for n in child.graph.nodes):
                setattr(split, name, _Piece(child, self.device_backend, self.stats))
        return split
