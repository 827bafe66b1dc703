"""The tile GEMM (cpu_tile_gemm.c) for batched decodes and prefill chunks, built on first use
(vllm/platforms/c_build.py).

It reads weights packed into AMX's tile layout by `pack` (a copy made at load, beside the plain
one), on AMX tiles where the CPU has them and Linux grants them, and on AVX512-BF16 dot products
elsewhere. Where it cannot be built, the CPU has neither, or VLLM_CPU_C_KERNELS=0, those rows
run on oneDNN's blocked copy instead.
"""

import ctypes
import functools

import torch

from vllm.model_executor.layers.cpu_product import PRODUCT, call_product
from vllm.platforms.c_library import KERNEL_SOURCES, CFunction, CLibrary

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64
_LIBRARY = CLibrary(KERNEL_SOURCES / "cpu_tile_gemm.c", "products of 5-512 rows stay on oneDNN",
                    {"tile_gemm_bf16": PRODUCT, "tile_gemm_silu_mul_bf16": PRODUCT,
                     "tile_pack_bf16": CFunction([_ptr, _ptr, _i64, _i64]),
                     "tile_gemm_fits": CFunction([_i64, _i64]),
                     "tile_gemm_use_amx": CFunction([ctypes.c_int])},
                    supported="tile_gemm_supported",
                    on_load=lambda lib: _set_amx(lib, True))  # AMX where the CPU and Linux allow it

# Whether the products run on the AMX copy: set when the library loads and by use_amx.
_on_amx = False


def _set_amx(lib: ctypes.CDLL, enabled: bool) -> bool:
    global _on_amx
    _on_amx = bool(lib.tile_gemm_use_amx(int(enabled)))
    return _on_amx


@functools.cache
def max_rows() -> int:
    """Rows that one pass of the kernel takes, 32, and so the most decodes a fused layer hands it
    (more rows go in 32-row slabs); 0 where it is not available. Builds it on the first call."""
    lib = _LIBRARY.get()
    return 0 if lib is None else lib.tile_gemm_supported()


def use_amx(enabled: bool) -> bool:
    """Lets the products take the AMX copy (the default where it runs) or not, the AVX512-BF16
    copy that CPUs without AMX use (for tests and comparisons); returns whether AMX is now in use.
    C layers built before (llama_cpu_layers.FusedLayers) keep the GEMV's rows of their build
    (takes_decode_rows)."""
    return _set_amx(_built(), enabled)


def takes_decode_rows() -> bool:
    """Whether products of a few rows (decodes), which cpu_gemv.c's GEMV would take from the
    plain weight, should run here too. On the AVX512-BF16 copy, yes: it streams the tile copy at
    least as fast, and it sums each output in the same order whatever the row count, so a token's
    result does not depend on how many rows its step has (the same tokens whatever the batch).
    On AMX the kernel computes a whole 16-row tile for each row group, and the GEMV keeps them."""
    return max_rows() > 0 and not _on_amx


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight: (N, K) bf16 -> its copy in the tile layout, or None if the kernel is unavailable
    or the shape does not fit (N a multiple of 16, K of 32)."""
    lib = _LIBRARY.get()
    if lib is None or weight.dtype != torch.bfloat16 or not lib.tile_gemm_fits(*weight.shape):
        return None
    weight = weight.detach().contiguous()
    packed = torch.empty_like(weight)                                  # (N, K) elements, tiled
    assert lib.tile_pack_bf16(weight.data_ptr(), packed.data_ptr(), *weight.shape) == 0
    return packed


def _built() -> ctypes.CDLL:
    lib = _LIBRARY.get()
    assert lib is not None
    return lib


def gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: (M, K) bf16, any M >= 1; packed: `pack(weight)` of an (N, K) weight -> (M, N)."""
    return call_product(_built().tile_gemm_bf16, x, packed, bias, packed.shape[0])


def gemm_silu_mul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: (M, K) bf16, any M >= 1; packed: `pack(weight)` of a merged gate/up weight (2 I, K),
    gate's rows then up's, 2 I % 32 == 0 -> silu(gate) * up, (M, I), rounded to bf16 as the
    product followed by SiLU-and-multiply would round. gate_up never goes to memory."""
    assert packed.shape[0] % 32 == 0
    return call_product(_built().tile_gemm_silu_mul_bf16, x, packed, bias, packed.shape[0] // 2)


def kernel_address(silu_mul: bool = False) -> int | None:
    """Address of the C function `tile_gemm_bf16` (with `silu_mul`, `tile_gemm_silu_mul_bf16`),
    for C code that calls it; None where unavailable."""
    return _LIBRARY.address("tile_gemm_silu_mul_bf16" if silu_mul else "tile_gemm_bf16")
