"""Loads the C decode-attention kernel (cpu_paged_decode.c), compiling it on first use.

The kernel reads each sequence's keys and values in place from the paged cache, so decodes
need no block gather, no padding to the longest sequence and no mask. It is built with the
system C compiler into VLLM_CACHE_ROOT (default ~/.cache/vllm), once per source, compiler
flags and CPU; without a compiler, or with VLLM_CPU_PAGED_DECODE=0, decodes fall back to the
gather + SDPA path in hpu_attn.py. It needs no torch headers, so a build takes about a second.
"""

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_paged_decode.c")
# -fopenmp links libgomp, the OpenMP runtime torch's CPU wheels load: the kernel's threads are
# torch's threads (same soname, one runtime in the process).
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_FUNCTIONS = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}
# The kernel's fixed-size buffers (MAX_HEADS, MAX_HEAD_DIM in the C source).
_MAX_HEADS = 64
_MAX_HEAD_DIM = 256


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _compile(compiler: str, library: Path) -> str | None:
    """Builds the kernel into `library`; returns the compiler's complaint if it fails."""
    library.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: processes building at once never load a half file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    result = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(tmp)
        return result.stderr[-2000:] or f"{compiler} exited with status {result.returncode}"
    os.replace(tmp, library)
    return None


def _build() -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("No C compiler found: decode attention gathers the cache blocks instead")
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS, _cpu_flags()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm")) / "kernels"
    library = cache / f"cpu_paged_decode_{key}.so"
    try:
        error = None if library.exists() else _compile(compiler, library)
        lib = None if error else ctypes.CDLL(str(library))
    except OSError as e:  # cache not writable, library not loadable
        error = str(e)
    if error:
        logger.warning("Building %s failed; decode attention gathers the cache blocks instead:\n%s",
                       _SOURCE.name, error)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in _FUNCTIONS.values():
        fn = getattr(lib, name)
        fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float]
        fn.restype = ctypes.c_int
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    flag = os.environ.get("VLLM_CPU_PAGED_DECODE", "1")
    if flag not in ("0", "1"):
        raise ValueError(f"VLLM_CPU_PAGED_DECODE={flag!r} must be 0 or 1")
    return _build() if flag == "1" else None


def is_available(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> bool:
    """Whether this model's decodes can use the kernel (builds it on the first call)."""
    return (device.type == "cpu" and dtype in _FUNCTIONS and num_heads % num_kv_heads == 0
            and num_heads <= _MAX_HEADS and head_dim <= _MAX_HEAD_DIM and _library() is not None)


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 sliding_window: int | None, out: torch.Tensor) -> None:
    """Writes the attention of each sequence's one query token into `out`.

    query, out: (S, H, D); caches: (num_blocks, block_size, KVH, D); block_tables: (S, B) int64;
    seq_lens: (S,) int64, keys per sequence (its cached tokens and this one).
    """
    lib = _library()
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
