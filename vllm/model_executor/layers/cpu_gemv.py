"""The C GEMVs for decode rows, built on first use (vllm/platforms/c_build.py): bf16 on
AVX512-BF16 dot products (cpu_gemv.c), up to 4 rows; float32 on AVX2 with FMA (cpu_gemv_f32.c),
up to F32_MAX_ROWS.

Where one cannot be built, the CPU lacks its ISA, or VLLM_CPU_C_KERNELS=0, linear layers of its
dtype keep oneDNN (bf16) or F.linear (float32) for every row count.
"""

import functools

import torch

from vllm.model_executor.layers.cpu_product import PRODUCT, call_product
from vllm.platforms.c_library import KERNEL_SOURCES, CLibrary

_LIBRARY = CLibrary(KERNEL_SOURCES / "cpu_gemv.c", "linear layers use oneDNN for decode rows too",
                    {"gemv_bf16": PRODUCT}, supported="gemv_supported")
_F32_LIBRARY = CLibrary(KERNEL_SOURCES / "cpu_gemv_f32.c", "float32 linear layers use F.linear for decode rows too",
                        {"gemv_f32": PRODUCT}, supported="gemv_f32_supported")

# Where the float32 kernel hands over to F.linear: on an AMD EPYC (Zen 3) it was ahead of MKL's
# up to 32 rows, level at 48 and 64, and behind at 128 (benchmarks/results/gemv_f32_epyc_zen3_avx2.json,
# benchmark_gemv.py --dtype float32).
F32_MAX_ROWS = 48


@functools.cache
def max_rows(dtype: torch.dtype = torch.bfloat16) -> int:
    """Largest row count the kernel for `dtype` takes (0: not available); builds it on the first call."""
    if dtype == torch.float32:
        lib = _F32_LIBRARY.get()
        return F32_MAX_ROWS if lib is not None and lib.gemv_f32_supported() else 0
    lib = _LIBRARY.get() if dtype == torch.bfloat16 else None
    return 0 if lib is None else lib.gemv_supported()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: (M, K) with M <= max_rows(x.dtype); weight: (N, K), both bf16 or both float32 ->
    (M, N) in their dtype."""
    assert 0 < x.shape[0] <= max_rows(x.dtype)
    assert weight.dtype == x.dtype and weight.is_contiguous()
    kernel = _F32_LIBRARY.get().gemv_f32 if x.dtype == torch.float32 else _LIBRARY.get().gemv_bf16
    return call_product(kernel, x, weight, bias, weight.shape[0])


def kernel_address(dtype: torch.dtype = torch.bfloat16) -> int | None:
    """Address of the C GEMV for `dtype` (`gemv_bf16` or `gemv_f32`), for C code that calls it;
    None where unavailable."""
    if dtype == torch.float32:
        return _F32_LIBRARY.address("gemv_f32")
    return _LIBRARY.address("gemv_bf16")
