"""The KV-cache write in C (cpu_kv_cache.c), built on first use (vllm/platforms/c_build.py):
each token's key and value rows copied to its slot, instead of two `index_copy_` calls from
the strided views inside qkv. Where it cannot be built, or with VLLM_CPU_C_KERNELS=0, the
caller keeps `index_copy_`.
"""

import ctypes

import torch

from vllm.platforms.c_library import KERNEL_SOURCES, CFunction, CLibrary

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_LIBRARY = CLibrary(KERNEL_SOURCES / "cpu_kv_cache.c", "the KV cache is written by index_copy_",
                    {"write_kv_rows": CFunction([_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64])})


def _rows_dense(x: torch.Tensor) -> bool:
    """Whether each token's (KVH, D) row of x is one contiguous run."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def write_rows(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               slot_mapping: torch.Tensor) -> bool:
    """key/value: (T, KVH, D), caches (num_blocks, block_size, KVH, D), slot_mapping (T,) int64.
    Writes each token's rows to its slot and returns True; False (nothing written) where the C
    copy does not apply: not CPU, a missing library, or layouts it does not take."""
    lib = _LIBRARY.get()
    if (lib is None or key.device.type != "cpu" or not (_rows_dense(key) and _rows_dense(value))
            or key.dtype != key_cache.dtype or value.dtype != value_cache.dtype
            or not (key_cache.is_contiguous() and value_cache.is_contiguous())
            or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()):
        return False
    assert key.shape == value.shape and key_cache.shape == value_cache.shape
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key_cache.shape[2:] == (num_kv_heads, head_dim) and slot_mapping.shape == (num_tokens,)
    item = key.element_size()
    status = lib.write_kv_rows(key.data_ptr(), key.stride(0) * item, value.data_ptr(), value.stride(0) * item,
                               slot_mapping.data_ptr(), num_tokens, num_kv_heads * head_dim * item,
                               key_cache.data_ptr(), value_cache.data_ptr(),
                               key_cache.shape[0] * key_cache.shape[1])
    if status:
        raise IndexError(f"a slot of slot_mapping lies outside the cache's "
                         f"{key_cache.shape[0] * key_cache.shape[1]} slots")
    return True
