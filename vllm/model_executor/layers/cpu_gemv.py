"""The C bf16 GEMV for decode rows (cpu_gemv.c), built on first use (vllm/platforms/c_build.py).

Where it cannot be built, the CPU lacks AVX512-BF16, or VLLM_CPU_C_KERNELS=0, linear layers keep
oneDNN for every row count.
"""

import functools

import torch

from vllm.model_executor.layers.cpu_product import PRODUCT, call_product
from vllm.platforms.c_library import KERNEL_SOURCES, CLibrary

_LIBRARY = CLibrary(KERNEL_SOURCES / "cpu_gemv.c", "linear layers use oneDNN for decode rows too",
                    {"gemv_bf16": PRODUCT}, supported="gemv_supported")


@functools.cache
def max_rows() -> int:
    """Largest row count the kernel takes (0: not available); builds it on the first call."""
    lib = _LIBRARY.get()
    return 0 if lib is None else lib.gemv_supported()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: (M, K) bf16 with M <= max_rows(); weight: (N, K) bf16 -> (M, N) bf16."""
    lib = _LIBRARY.get()
    assert lib is not None and 0 < x.shape[0] <= max_rows()
    assert weight.dtype == torch.bfloat16 and weight.is_contiguous()
    return call_product(lib.gemv_bf16, x, weight, bias, weight.shape[0])


def kernel_address() -> int | None:
    """Address of the C function `gemv_bf16`, for C code that calls it; None where unavailable."""
    return _LIBRARY.address("gemv_bf16")
