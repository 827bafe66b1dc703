"""The C prefill-attention kernel (cpu_paged_prefill.c), built on first use (vllm/platforms/c_build.py).

Prefill chunks attend to their cached context and to their own keys in one pass that reads
the paged cache in place, on AMX tiles where the CPU has them, on AVX512-BF16 dot products
elsewhere, and in float32 on FMAs where AVX2 is the widest ISA. It takes bf16 with head_dim 64
and a block size that is a multiple of 16; elsewhere (and where it cannot be built, the CPU
lacks AVX2, or VLLM_CPU_C_KERNELS=0), prefills keep the gather + flash-attention path in
vllm/attention/backends/cpu_attn.py.
"""

import ctypes

import torch

from vllm.platforms.c_library import KERNEL_SOURCES, CFunction, CLibrary

_LIBRARY = CLibrary(
    KERNEL_SOURCES / "cpu_paged_prefill.c", "prefills keep torch's flash attention",
    {"paged_prefill_bf16": CFunction([ctypes.c_void_p] * 8 + [ctypes.c_int64] * 8 + [ctypes.c_float]),
     "paged_prefill_head_dim": CFunction([]), "paged_prefill_use_amx": CFunction([ctypes.c_int])},
    supported="paged_prefill_supported",
    on_load=lambda lib: lib.paged_prefill_use_amx(1))  # AMX where the CPU and Linux allow it


def is_available(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int) -> bool:
    """Whether this model's prefills can use the kernel (builds it on the first call)."""
    if device.type != "cpu" or dtype != torch.bfloat16 or num_heads % num_kv_heads or block_size % 16:
        return False
    lib = _LIBRARY.get()
    return lib is not None and head_dim == lib.paged_prefill_head_dim()


def use_amx(enabled: bool) -> bool:
    """Lets prefills take the AMX copy (the default where it runs) or not, the vector copy that
    CPUs without AMX use, AVX512-BF16's or AVX2's (for tests and comparisons); returns whether
    AMX is now in use."""
    lib = _LIBRARY.get()
    assert lib is not None, "call is_available() first"
    return bool(lib.paged_prefill_use_amx(int(enabled)))


def paged_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_tables: torch.Tensor, token_offsets: torch.Tensor, query_lens: torch.Tensor,
                  context_lens: torch.Tensor, scale: float, sliding_window: int | None,
                  out: torch.Tensor) -> None:
    """Writes the causal attention of each prefill chunk's queries into their rows of `out`.

    query, out: (T, H, D), query's heads contiguous (its rows may be strided: q inside the rotated
    q|k rows), out contiguous; caches: (num_blocks, block_size, KVH, D), the chunks' own keys and
    values already written; block_tables: (S, B) int64; token_offsets, query_lens and
    context_lens: (S,) int64, where each chunk's queries start in the step, how many there are,
    and how many of its sequence's keys were cached before it.
    """
    lib = _LIBRARY.get()
    assert lib is not None, "call is_available() first"
    tensors = (query, key_cache, value_cache, block_tables, token_offsets, query_lens, context_lens, out)
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in tensors[1:])
    assert query.device.type == "cpu" and query.stride(2) == 1 and query.stride(1) == query.shape[2]
    assert query.dtype == key_cache.dtype == value_cache.dtype == out.dtype == torch.bfloat16
    assert all(t.dtype == torch.int64 for t in tensors[3:7])
    assert query.shape == out.shape
    num_seqs = block_tables.shape[0]
    assert token_offsets.shape == query_lens.shape == context_lens.shape == (num_seqs,)
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    status = lib.paged_prefill_bf16(*(t.data_ptr() for t in tensors), query.stride(0), num_seqs, num_heads,
                                    num_kv_heads, head_dim, block_size, block_tables.shape[1],
                                    sliding_window or 0, scale)
    assert status == 0, f"paged_prefill_bf16 failed with status {status} (1: shape, 2: out of memory)"


def kernel_address() -> int | None:
    """Address of the C function `paged_prefill_bf16`, for C code that calls it; None where
    unavailable."""
    return _LIBRARY.address("paged_prefill_bf16")
