import ctypes
import ctypes.util
import functools
import os
import sys

import torch

from vllm.logger import init_logger
from vllm.platforms.cpu_threads import ThreadGovernor, adaptive_threads_enabled
from vllm.platforms.interface import Platform


# The vector extensions past x86-64-v3 (AVX2, FMA, F16C) that cpu_flags() leaves out under
# VLLM_CPU_ISA=avx2.
_PAST_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ne_convert", "avx_ifma", "avx10")


def cpu_isa() -> str:
    """VLLM_CPU_ISA: "" (the default) runs on everything this CPU has; "avx2" runs as an AVX2-only
    x86-64 CPU would (x86-64-v3): the engine's choices see no later extension and the C kernels
    are built for x86-64-v3 (vllm/platforms/c_build.py). torch's own kernels follow
    ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2, which must be set before it is imported."""
    isa = os.environ.get("VLLM_CPU_ISA", "")
    if isa not in ("", "avx2"):
        raise ValueError(f"VLLM_CPU_ISA={isa!r} must be empty or 'avx2'")
    return isa


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags of this CPU (Linux /proc/cpuinfo; empty elsewhere), without those past
    AVX2 under VLLM_CPU_ISA=avx2."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    flags = line.partition(":")[2].split()
    if cpu_isa() == "avx2":
        flags = [flag for flag in flags if not flag.startswith(_PAST_AVX2)]
    return frozenset(flags)


def cpu_has_amx_bf16() -> bool:
    return "amx_bf16" in cpu_flags()


def cpu_has_native_bf16_dot() -> bool:
    """Whether the CPU computes bf16 dot products natively: AMX tiles (Intel Sapphire Rapids and
    later) or AVX512-BF16's dot-product instructions (AMD Zen 4/5, Intel Cooper Lake). oneDNN's
    bf16 GEMMs run there at a multiple of the fp32 rate; elsewhere they convert to fp32 first."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


logger = init_logger(__name__)

# glibc mallopt parameters
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3


def keep_freed_memory_in_process() -> bool:
    """Stops glibc from returning each freed activation buffer to the kernel.

    By default glibc serves blocks above a few hundred KiB with mmap and unmaps them on free, so
    every eager op on a (512, 576) activation page-faults its output in again, and for a
    small element-wise op the faults cost several times the op itself. Keeping blocks of
    up to 32 MiB (glibc's maximum mmap threshold) on the heap, and not trimming it, lets the
    allocator reuse them. This is what LD_PRELOAD'ing tcmalloc or jemalloc does for vLLM's CPU
    backend. Returns whether the settings were applied (glibc only).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        ok = (libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1
              and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
              and libc.mallopt(_M_TOP_PAD, 64 << 20) == 1)
    except (OSError, AttributeError):
        ok = False
    if not ok:
        logger.info("Could not tune the C allocator (not glibc?); eager ops may page-fault more")
    return ok


class CpuPlatform(Platform):
    device_type = "cpu"
    # A cold start compiles for tens of seconds (benchmarks/results/graphs.json records the
    # warm-up and how graphs compare with eager), so eager stays the default and an LLM starts
    # in seconds; servers that run for long may pass enforce_eager=False.
    default_enforce_eager = True
    # Inductor's C++ kernels take the size as an argument and run as fast as kernels specialized
    # per bucket, so the model is compiled once instead of once per bucket.
    symbolic_token_count = True
    # Every step is padded to a captured bucket or runs eagerly: the parameter guards can go.
    skip_guards_after_warmup = True
    # Decodes of a few rows run on the C GEMV (vllm/csrc/cpu/cpu_gemv.c), faster
    # than oneDNN at larger padded sizes, so small buckets pay; 2, not 1, because dynamo gives
    # size 1 a graph of its own while 2 shares the symbolic one.
    min_token_bucket = 2
    # GGUF blocks kept quantized, and int8 weights made at load in Q8_0 blocks
    # (vllm/model_executor/layers/quantization/).
    supported_quantization = ("gguf", "int8")

    def __init__(self) -> None:
        super().__init__()
        # dtype="auto" for unquantized weights: bf16 where the CPU has native bf16 dot products,
        # fp32 elsewhere (AVX2-only CPUs emulate bf16 GEMMs and gain nothing over fp32 but its
        # rounding). Quantized weights: auto_dtype.
        self.default_dtype = torch.bfloat16 if cpu_has_native_bf16_dot() else torch.float32
        keep_freed_memory_in_process()

    def auto_dtype(self, quantization, quantized_types=frozenset()):
        # GGUF blocks of types the int8 GEMM decodes here (AVX2 and later) multiply x's int8
        # codes at every row count and never reach torch's bf16 GEMM, so bf16 is the faster
        # choice there even without native bf16 dot products (the C layers run bf16 steps only,
        # and bf16 halves the activations' and the KV cache's bytes), and a token's result does
        # not depend on its step. Other types' bf16 products change with the row count there.
        from vllm.model_executor.layers.quantization import cpu_gguf_gemv, gguf_blocks

        if quantization == "gguf" and quantized_types and all(
                cpu_gguf_gemv.gemm_takes(gguf_blocks.type_of(name)) for name in quantized_types):
            return torch.bfloat16
        return self.default_dtype

    def gguf_kernel_types(self):
        from vllm.model_executor.layers.quantization import cpu_gguf_gemv, gguf_blocks

        # Without the C library the products dequantize whole weights each time: correct, slow.
        return frozenset(gguf_blocks.supported_type_names()) if cpu_gguf_gemv.available() else frozenset()

    def configure_worker(self, world_size):
        # The ranks share the host's cores: each gets its part, at least one thread.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // world_size))

    def build_kernels(self):
        from vllm.platforms import c_build

        c_build.build_kernels()

    def thread_governor(self):
        # Read after configure_worker: the governor never runs more threads than the rank's share.
        threads = torch.get_num_threads()
        if threads < 2 or not adaptive_threads_enabled():
            return None
        return ThreadGovernor(threads, torch.set_num_threads)

    def attention_backend(self, config, sliding_window):
        from vllm.attention.backends.cpu_attn import CpuAttentionBackend

        return CpuAttentionBackend(config, sliding_window, self.device)

    def capture_model(self, model):
        # Inductor generates C++ kernels that fuse the norms, rotary and activation element-wise
        # ops around the GEMMs; attention is an opaque op inside the one graph. Shapes are static
        # except the token dimension, which the runner marks dynamic.
        return torch.compile(model, dynamic=False, fullgraph=True)
