from torch import nn

from habana_frameworks.recorder import RECORDER, signature


def is_available() -> bool:
    return True


def synchronize() -> None:
    pass


# Device memory the double reports: (free, total) bytes. Tests may set it.
MEMORY = {"free": 2 * 1024**3, "total": 2 * 1024**3}


def mem_get_info() -> tuple[int, int]:
    return MEMORY["free"], MEMORY["total"]


class _HpuGraph(nn.Module):
    """Captures a graph per new input signature, replays it for a known one (here: runs it)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args):
        key = ("hpu_graph", type(self.module).__name__, signature(args))
        if key not in RECORDER.graph_keys:
            RECORDER.capture(key)
        with RECORDER.running(key):
            return self.module(*args)


def wrap_in_hpu_graph(module: nn.Module, **kwargs) -> nn.Module:
    assert not kwargs or set(kwargs) <= {"asynchronous", "disable_tensor_cache", "dry_run", "max_graphs"}
    return _HpuGraph(module)
