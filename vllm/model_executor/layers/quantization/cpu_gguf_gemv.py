"""The C products on GGUF blocks (cpu_gguf_gemv.c), built on first use (vllm/platforms/c_build.py).

Where the library cannot be built (no compiler, VLLM_CPU_C_KERNELS=0) the layers dequantize
with the gguf package instead (gguf_linear.py); where it is built without AVX2 (no int8
products), `int8_available()` is False and every product takes the float32 path.
"""

import ctypes
import functools

import torch

from vllm.model_executor.layers import cpu_tile_gemm
from vllm.model_executor.layers.cpu_product import PRODUCT
from vllm.model_executor.layers.quantization.gguf_blocks import PANELS
from vllm.platforms.c_library import KERNEL_SOURCES, CFunction, CLibrary

_ptr, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_MATMUL = CFunction([_ptr, _int, _ptr, _int, _ptr, _ptr, _i64, _i64, _i64])
_PRODUCT_BF16 = CFunction([_ptr, _ptr, _int, _ptr, _ptr, _i64, _i64, _i64])
# The decoder layer's products (llama_cpu_layers.c), one per type and layout: type -> name.
_LAYER_PRODUCTS = {8: "gguf_layer_product_q8_0", 2: "gguf_layer_product_q4_0", 3: "gguf_layer_product_q4_1",
                   12: "gguf_layer_product_q4_k", 14: "gguf_layer_product_q6_k",
                   8 | PANELS: "gguf_layer_product_q8_0_panels",
                   2 | PANELS: "gguf_layer_product_q4_0_panels", 3 | PANELS: "gguf_layer_product_q4_1_panels"}
_LIBRARY = CLibrary(KERNEL_SOURCES / "cpu_gguf_gemv.c",
                    "GGUF weights are dequantized with the gguf package for every product",
                    {"gguf_matmul_float": _MATMUL, "gguf_matmul_int8": _MATMUL,
                     "gguf_int8_supported": CFunction([]),
                     "gguf_dequantize": CFunction([_ptr, _int, _ptr, _i64, _i64, _i64, _ptr, _int]),
                     "gguf_product_bf16": _PRODUCT_BF16, "gguf_tiled_product_bf16": _PRODUCT_BF16,
                     "gguf_gemm_int8_bf16": _PRODUCT_BF16, "gguf_gemm_supported": CFunction([]),
                     "gguf_gemm_decodes": CFunction([_int]), "gguf_has_panels": CFunction([_int]),
                     "gguf_product_path": CFunction([_int, _i64, _i64, _i64]),
                     "gguf_use_tile_gemm": CFunction([_ptr]),
                     "gguf_to_panels": CFunction([_ptr, _int, _i64, _i64, _ptr]),
                     **{name: PRODUCT for name in _LAYER_PRODUCTS.values()}},
                    on_load=lambda lib: lib.gguf_use_tile_gemm(cpu_tile_gemm.kernel_address()))


def available() -> bool:
    """Whether the C kernels are built here (builds them on the first call)."""
    return _LIBRARY.get() is not None


@functools.cache
def int8_available() -> bool:
    """Whether this build has the int8-activation product (AVX2 and later x86-64 extensions)."""
    lib = _LIBRARY.get()
    return lib is not None and lib.gguf_int8_supported() == 1


def _operands(x: torch.Tensor, blocks: torch.Tensor,
              bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Checks a product's operands: x (M, K) float32 or bf16, blocks (N, row bytes), bias (N,) in
    x's dtype or None. Returns x and bias contiguous, and y (M, N) in x's dtype to write."""
    assert x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2
    assert blocks.dtype == torch.uint8 and blocks.is_contiguous()
    if bias is not None:
        assert bias.dtype == x.dtype and bias.shape == (blocks.shape[0],)
        bias = bias.contiguous()
    return x.contiguous(), bias, x.new_empty(x.shape[0], blocks.shape[0])        # y: (M, N)


def matmul(x: torch.Tensor, blocks: torch.Tensor, quant_type: int, int8_activations: bool,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: (M, K) float32 or bf16; blocks: (N, row bytes) of `quant_type`; bias: (N,) in x's
    dtype or None -> (M, N) in x's dtype, the bias added to the float32 sums.

    `int8_activations` quantizes x per block of 32 to int8 (only where `int8_available()`)."""
    lib = _LIBRARY.get()
    assert lib is not None and (not int8_activations or int8_available())
    x, bias, y = _operands(x, blocks, bias)
    (m, k), n = x.shape, blocks.shape[0]
    kernel = lib.gguf_matmul_int8 if int8_activations else lib.gguf_matmul_float
    status = kernel(x.data_ptr(), x.dtype == torch.bfloat16, blocks.data_ptr(), quant_type,
                    None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k)
    assert status == 0, f"gguf matmul failed with status {status}"
    return y


@functools.cache
def _tiled_available() -> bool:
    return available() and cpu_tile_gemm.kernel_address() is not None


def tiled_fits(n: int) -> bool:
    """Whether the tiled product (dequantized panels on cpu_tile_gemm.c) can run on n output rows
    (K whole blocks, as GGUF rows are): the tile GEMM is available here and n is a multiple of 16."""
    return n % 16 == 0 and _tiled_available()


@functools.cache
def gemm_available() -> bool:
    """Whether this build has the int8 GEMM (AVX512-VNNI, or AVX2's pair products where that is
    the widest), for any number of output rows."""
    lib = _LIBRARY.get()
    return lib is not None and lib.gguf_gemm_supported() == 1


def gemm_takes(quant_type: int) -> bool:
    """Whether the int8 GEMM is built here and decodes `quant_type` (in rows or panels)."""
    lib = _LIBRARY.get()
    return gemm_available() and lib.gguf_gemm_decodes(quant_type) == 1


def to_panels(blocks: torch.Tensor, quant_type: int, k: int) -> torch.Tensor | None:
    """blocks: (N, row bytes) of rows of K weights of `quant_type` -> the same bytes regrouped
    into 16-row panels (cpu_gguf_gemv_blocks.h), which the int8 GEMM reads in one stream where from
    rows it gathers 16 rows' blocks; multiply and dequantize them as `quant_type | PANELS`.
    None where the GEMM does not take the type here, the type has no panels (Q4_K: the GEMM
    reads its rows) or N is not a multiple of 16."""
    if quant_type & PANELS or blocks.shape[0] % 16 or not gemm_takes(quant_type):
        return None
    if not _LIBRARY.get().gguf_has_panels(quant_type):
        return None
    assert blocks.dtype == torch.uint8 and blocks.dim() == 2 and blocks.is_contiguous()
    panels = torch.empty_like(blocks)
    status = _LIBRARY.get().gguf_to_panels(blocks.data_ptr(), quant_type, blocks.shape[0], k, panels.data_ptr())
    assert status == 0, f"gguf_to_panels failed with status {status}"
    return panels


@functools.cache
def batched_fits(quant_type: int, n: int, k: int) -> bool:
    """Whether bf16 products on n rows of K weights of `quant_type` have a product made for many
    rows of x here (the int8 GEMM or the tiled product), so that `product` serves them at any row
    count: the one `product_path` takes for a large chunk."""
    return available() and product_path(quant_type, 1 << 16, n, k) in ("gemm", "tiled")


# gguf_product_path's answers, in its order.
PATHS = ("float", "int8", "gemm", "tiled")


def product_path(quant_type: int, m: int, n: int, k: int) -> str:
    """The product `product` runs for m rows of bf16 x on n rows of K weights of `quant_type`, as
    benchmarks/benchmark_gguf_products.py measures them: "gemm" at every row count where the
    int8 GEMM is built and decodes the type (`gemm_takes`); elsewhere "int8" (or "float" without
    int8 dot products) for a few rows and "tiled" from there where it runs."""
    lib = _LIBRARY.get()
    assert lib is not None
    return PATHS[lib.gguf_product_path(quant_type, m, n, k)]


def product(x: torch.Tensor, blocks: torch.Tensor, quant_type: int, bias: torch.Tensor | None,
            path: str | None = None) -> torch.Tensor:
    """The C decoder layer's product for bf16 x: (M, K) bf16, blocks (N, row bytes), bias (N,)
    bf16 or None -> (M, N) bf16, on the product `product_path` chooses; `path` (one of PATHS,
    where it runs here) forces one, for measuring and testing."""
    lib = _LIBRARY.get()
    assert lib is not None and x.dtype == torch.bfloat16 and (path is None or path in PATHS)
    if path in ("float", "int8"):
        return matmul(x, blocks, quant_type, path == "int8", bias)
    x, bias, y = _operands(x, blocks, bias)
    (m, k), n = x.shape, blocks.shape[0]
    assert path != "gemm" or gemm_takes(quant_type)
    assert path != "tiled" or tiled_fits(n)
    kernel = {None: lib.gguf_product_bf16, "gemm": lib.gguf_gemm_int8_bf16, "tiled": lib.gguf_tiled_product_bf16}[path]
    status = kernel(x.data_ptr(), blocks.data_ptr(), quant_type, None if bias is None else bias.data_ptr(),
                    y.data_ptr(), m, n, k)
    assert status == 0, f"gguf product failed with status {status}"
    return y


def dequantize(blocks: torch.Tensor, quant_type: int, k: int, dtype: torch.dtype,
               rows: torch.Tensor | None = None) -> torch.Tensor:
    """blocks: (N, row bytes) -> (N, K), or (R, K) for the row ids `rows` (R,) in [0, N) (else
    IndexError), in dtype (float32 or bf16; float32 values are the gguf package's exactly)."""
    lib = _LIBRARY.get()
    assert lib is not None and blocks.dtype == torch.uint8 and blocks.is_contiguous()
    assert dtype in (torch.float32, torch.bfloat16)
    if rows is not None:
        rows = rows.to(torch.int64).contiguous()
        assert rows.dim() == 1
    count = blocks.shape[0] if rows is None else rows.shape[0]
    out = torch.empty(count, k, dtype=dtype)                                   # (R, K)
    status = lib.gguf_dequantize(blocks.data_ptr(), quant_type, None if rows is None else rows.data_ptr(),
                                 count, blocks.shape[0], k, out.data_ptr(), dtype == torch.bfloat16)
    if status == 3:
        raise IndexError(f"a row id is outside the {blocks.shape[0]} rows of the blocks")
    assert status == 0, f"gguf dequantize failed with status {status}"
    return out


def layer_product_address(quant_type: int) -> int | None:
    """Address of the decoder layer's product on blocks of `quant_type`: `product` (the same
    choice by rows), in cpu_product.py's calling convention with the weight given as its rows of
    blocks, for llama_cpu_layers.c; None where unavailable."""
    return _LIBRARY.address(_LAYER_PRODUCTS[quant_type])
