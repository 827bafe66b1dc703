"""The calling convention the C products of linear layers share (cpu_gemv.c's and
cpu_gemv_f32.c's GEMVs, cpu_tile_gemm.c's tile GEMM and its SiLU-and-multiply variant):

    int kernel(const T *x, const T *weight, const T *bias_or_null, T *y,
               int64 m, int64 n, int64 k)      x (m, k), weight n rows of k, y (m, columns)

with T bf16 (float32 for cpu_gemv_f32.c), returning 0 on success.
"""

import ctypes

import torch

from vllm.platforms.c_library import CFunction

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64
PRODUCT = CFunction([_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64])


def call_product(kernel, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 columns: int) -> torch.Tensor:
    """x: (M, K) bf16 or float32, M >= 1; weight: N rows of K (plain or tile-packed) -> (M, columns)
    in x's dtype, the kernel's T."""
    assert x.shape[0] > 0 and x.dtype in (torch.bfloat16, torch.float32)
    assert bias is None or (bias.dtype == x.dtype and bias.is_contiguous())
    x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    assert weight.shape[1] == k
    if bias is not None and bias.shape != (n,):  # the kernel reads n values of it
        raise ValueError(f"bias of shape {tuple(bias.shape)} for a product of {n} outputs")
    y = x.new_empty(m, columns)                                                # (M, columns)
    status = kernel(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                    y.data_ptr(), m, n, k)
    assert status == 0
    return y
