"""Three element-wise steps of a Llama layer in C for bf16 rows on CPU (cpu_layer_ops.c): RMS
norm (alone or after the residual add), the rotary embedding and SiLU-and-multiply, one pass
each instead of 7 (8 with the add), 4 and 2 torch ops.

Modules with a C path carry `c_kernels`, which the CPU attention backend turns on for bf16
models (vllm/attention/backends/cpu_attn.py). Used by the eager path only (`usable`): inside a
captured graph the compiler fuses the torch ops itself. Where the library cannot be built, or
with VLLM_CPU_C_KERNELS=0, the torch ops run.
"""

import ctypes

import torch

from vllm.platforms.c_library import KERNEL_SOURCES, CFunction, CLibrary

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64
_LIBRARY = CLibrary(KERNEL_SOURCES / "cpu_layer_ops.c", "norms and rotary run as torch ops", {
    "rms_norm_bf16": CFunction([_ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float]),
    "add_rms_norm_bf16": CFunction([_ptr, _ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float]),
    "rotary_bf16": CFunction([_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64]),
    "silu_mul_bf16": CFunction([_ptr, _ptr, _i64, _i64]),
})


def usable(x: torch.Tensor) -> bool:
    """Whether `x`'s element-wise steps run here: bf16, outside a captured graph. Callers ask
    only where the CPU backend turned their `c_kernels` on, so `x` is in host memory."""
    return x.dtype == torch.bfloat16 and not torch.compiler.is_compiling() and _LIBRARY.get() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (T, n) bf16, weight: (n,) bf16 -> (T, n)."""
    assert weight.dtype == torch.bfloat16 and weight.is_contiguous() and x.shape[-1] == weight.shape[0]
    x = x.contiguous()
    y = torch.empty_like(x)
    _LIBRARY.get().rms_norm_bf16(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // x.shape[-1],
                             x.shape[-1], eps)
    return y


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> torch.Tensor:
    """residual, delta: (T, n) bf16, weight: (n,) bf16. Adds delta into `residual` in place and
    returns rms_norm(residual), (T, n): one pass instead of torch's add and then the norm."""
    assert weight.dtype == residual.dtype == delta.dtype == torch.bfloat16 and weight.is_contiguous()
    assert residual.is_contiguous() and residual.shape == delta.shape and residual.shape[-1] == weight.shape[0]
    delta = delta.contiguous()
    y = torch.empty_like(residual)
    _LIBRARY.get().add_rms_norm_bf16(residual.data_ptr(), delta.data_ptr(), weight.data_ptr(), y.data_ptr(),
                                 residual.numel() // residual.shape[-1], residual.shape[-1], eps)
    return y


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, D) bf16 with contiguous heads (rows may be strided, as q and k inside qkv);
    cos, signed_sin: (T, 1, D) -> rotated (T, heads, D), contiguous."""
    t, heads, d = x.shape
    assert x.stride(2) == 1 and x.stride(1) == d and cos.is_contiguous() and signed_sin.is_contiguous()
    assert cos.dtype == signed_sin.dtype == torch.bfloat16 and cos.shape == (t, 1, d)
    y = x.new_empty(t, heads, d)
    _LIBRARY.get().rotary_bf16(x.data_ptr(), x.stride(0), cos.data_ptr(), signed_sin.data_ptr(), y.data_ptr(),
                           t, heads, d)
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (T, 2 I) bf16, gate then up -> silu(gate) * up, (T, I)."""
    gate_up = gate_up.contiguous()
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(t, n)
    _LIBRARY.get().silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), t, n)
    return out
