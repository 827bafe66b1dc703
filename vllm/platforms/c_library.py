"""A C kernel file as its Python wrapper sees it: built on first use, its functions typed once.

Each wrapper of a C kernel (vllm/attention/ops/cpu_*.py, vllm/model_executor/layers/cpu_*.py,
vllm/model_executor/models/llama_cpu_layers.py) declares one `CLibrary`: its source in
vllm/csrc/cpu/, the path that runs where it is unavailable, the ctypes signature of every
function it calls, and, where the CPU decides, the C function that says whether the kernels run
here:

    _LIBRARY = CLibrary(KERNEL_SOURCES / "cpu_gemv.c", "linear layers use oneDNN",
                        {"gemv_bf16": CFunction([ptr, ptr, ptr, ptr, i64, i64, i64])},
                        supported="gemv_supported")
    lib = _LIBRARY.get()                      # None: keep the torch path
    address = _LIBRARY.address("gemv_bf16")   # for C code that calls the kernel

The build itself (compiler, flags, cache, VLLM_CPU_C_KERNELS) is vllm/platforms/c_build.py's.
"""

import ctypes
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from vllm.platforms.c_build import KERNEL_SOURCES, load_c_library

__all__ = ["KERNEL_SOURCES", "CFunction", "CLibrary"]


class CFunction(NamedTuple):
    """The ctypes signature of a C function; the kernels return an int status by default."""
    argtypes: Sequence[Any]
    restype: Any = ctypes.c_int


_NOT_LOADED = object()


class CLibrary:
    """One C source, built and loaded on the first `get()`, with its functions' signatures set.

    `supported` names a C function without arguments that returns 0 where this CPU (or Linux)
    cannot run the kernels: the library then counts as unavailable, as if it could not be
    built. `on_load` runs once on the loaded, typed library (a kernel's one-off set-up).
    """

    def __init__(self, source: Path, fallback: str, functions: Mapping[str, CFunction], *,
                 supported: str | None = None, on_load: Callable[[ctypes.CDLL], object] | None = None
                 ) -> None:
        self.source = source
        self._fallback = fallback  # logged, with the reason, where the library cannot be built
        self._functions = dict(functions)
        self._supported = supported
        self._on_load = on_load
        self._lib: Any = _NOT_LOADED

    def get(self) -> ctypes.CDLL | None:
        """The typed library, or None: not built here (no compiler, a failed build,
        VLLM_CPU_C_KERNELS=0) or not supported by this CPU. Builds it on the first call."""
        if self._lib is _NOT_LOADED:
            self._lib = self._load()
        return self._lib

    def address(self, function: str) -> int | None:
        """Address of the declared C function `function`, for C code that calls it through a
        pointer; None where the library is unavailable."""
        assert function in self._functions, f"{function} is not declared for {self.source.name}"
        lib = self.get()
        return None if lib is None else ctypes.cast(getattr(lib, function), ctypes.c_void_p).value

    def _load(self) -> ctypes.CDLL | None:
        lib = load_c_library(self.source, self._fallback)
        if lib is None or (self._supported is not None and getattr(lib, self._supported)() == 0):
            return None
        for name, signature in self._functions.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = list(signature.argtypes), signature.restype
        if self._on_load is not None:
            self._on_load(lib)
        return lib
