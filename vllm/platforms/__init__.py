"""Device selection. `get_platform("auto")` picks Gaudi when its stack is installed, else CPU."""

from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.hpu import HpuPlatform, hpu_stack_installed
from vllm.platforms.interface import Platform

__all__ = ["Platform", "get_platform"]


def get_platform(device: str = "auto") -> Platform:
    if device == "auto":
        device = "hpu" if hpu_stack_installed() else "cpu"
    if device == "cpu":
        return CpuPlatform()
    if device == "hpu":
        return HpuPlatform()
    raise ValueError(f"device={device!r} is not supported; use 'auto', 'cpu' or 'hpu'")
