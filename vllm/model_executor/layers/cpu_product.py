"""The calling convention the C bf16 products of linear layers share (cpu_gemv.c's GEMV,
cpu_tile_gemm.c's tile GEMM and its SiLU-and-multiply variant):

    int kernel(const bf16 *x, const bf16 *weight, const bf16 *bias_or_null, bf16 *y,
               int64 m, int64 n, int64 k)      x (m, k), weight n rows of k, y (m, columns)

returning 0 on success.
"""

import ctypes

import torch

from vllm.platforms.c_library import CFunction

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64
PRODUCT = CFunction([_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64])


def call_product(kernel, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 columns: int) -> torch.Tensor:
    """x: (M, K) bf16, M >= 1; weight: N rows of K (plain or tile-packed) -> (M, columns) bf16."""
    assert x.shape[0] > 0 and x.dtype == torch.bfloat16
    assert bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())
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
