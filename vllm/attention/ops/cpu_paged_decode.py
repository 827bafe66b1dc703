"""The C decode-attention kernel (cpu_paged_decode.c), built on first use (vllm/platforms/c_build.py).

The kernel reads each sequence's keys and values in place from the paged cache, so decodes
need no block gather, no padding to the longest sequence and no mask. Where it cannot be
built, or with VLLM_CPU_C_KERNELS=0, decodes take the gather + SDPA path in
vllm/attention/backends/cpu_attn.py.
"""

import ctypes

import torch

from vllm.platforms.c_library import KERNEL_SOURCES, CFunction, CLibrary

_FUNCTIONS = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_DECODE = CFunction([_ptr] * 6 + [_i64] * 7 + [ctypes.c_float])
_LIBRARY = CLibrary(
    KERNEL_SOURCES / "cpu_paged_decode.c", "decode attention gathers the cache blocks instead",
    {**{name: _DECODE for name in _FUNCTIONS.values()},
     "paged_decode_max_heads": CFunction([], _i64), "paged_decode_max_head_dim": CFunction([], _i64),
     "paged_decode_use_amx": CFunction([ctypes.c_int])},
    on_load=lambda lib: lib.paged_decode_use_amx(1))  # bf16 on AMX where the CPU and Linux allow it


def is_available(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> bool:
    """Whether this model's decodes can use the kernel (builds it on the first call)."""
    if device.type != "cpu" or dtype not in _FUNCTIONS or num_heads % num_kv_heads:
        return False
    lib = _LIBRARY.get()
    return (lib is not None and num_heads <= lib.paged_decode_max_heads()
            and head_dim <= lib.paged_decode_max_head_dim())


def use_amx(enabled: bool) -> bool:
    """Lets bf16 decodes take the AMX copy (the default where it runs) or not, the AVX512 copies
    that CPUs without AMX use (for tests and comparisons); returns whether AMX is now in use."""
    lib = _LIBRARY.get()
    assert lib is not None, "call is_available() first"
    return bool(lib.paged_decode_use_amx(int(enabled)))


def kernel_address(dtype: torch.dtype) -> int | None:
    """Address of the C kernel for `dtype`, for C code that calls it; None where unavailable."""
    return _LIBRARY.address(_FUNCTIONS[dtype]) if dtype in _FUNCTIONS else None


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 sliding_window: int | None, out: torch.Tensor) -> None:
    """Writes the attention of each sequence's one query token into `out`.

    query, out: (S, H, D); caches: (num_blocks, block_size, KVH, D); block_tables: (S, B) int64;
    seq_lens: (S,) int64, keys per sequence (its cached tokens and this one).
    """
    lib = _LIBRARY.get()
    assert lib is not None, "call is_available() first"
    tensors = (query, key_cache, value_cache, block_tables, seq_lens, out)
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in tensors)
    assert query.dtype == key_cache.dtype == value_cache.dtype == out.dtype
    assert block_tables.dtype == seq_lens.dtype == torch.int64
    assert query.shape == out.shape and query.shape[0] == block_tables.shape[0] == seq_lens.shape[0]
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1:3]
    status = getattr(lib, _FUNCTIONS[query.dtype])(
        *(t.data_ptr() for t in tensors), num_seqs, num_heads, num_kv_heads, head_dim,
        block_size, block_tables.shape[1], sliding_window or 0, scale)
    assert status == 0, "shape outside the kernel's limits; is_available() rules these out"
