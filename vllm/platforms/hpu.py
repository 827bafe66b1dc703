"""Intel Gaudi. `habana_frameworks` is imported here only, and only when this platform is chosen."""

import functools
import importlib.util

import torch

from vllm.platforms.interface import Platform


def hpu_stack_installed() -> bool:
    return importlib.util.find_spec("habana_frameworks") is not None


class HpuPlatform(Platform):
    device_type = "hpu"
    default_dtype = torch.bfloat16

    def __init__(self) -> None:
        if not hpu_stack_installed():
            raise ValueError("device='hpu' needs the Intel Gaudi software stack (habana_frameworks), "
                             "which is not installed; use device='cpu'")
        import habana_frameworks.torch.core as htcore  # registers the "hpu" device with torch

        self._htcore = htcore
        if not torch.hpu.is_available():
            raise ValueError("device='hpu' was requested but no Gaudi device is visible")

    def synchronize(self) -> None:
        torch.hpu.synchronize()

    def mark_step(self) -> None:
        self._htcore.mark_step()

    def compile_fn(self):
        # The Gaudi graph compiler behind torch.compile; static shapes, one recipe per bucket.
        return functools.partial(torch.compile, backend="hpu_backend", dynamic=False, fullgraph=True)
