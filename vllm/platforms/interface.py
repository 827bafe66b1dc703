"""What the engine needs to know about the device it runs on.

The platform is the one place that knows the device: which attention backend runs there, how the
model and smaller regions are captured as graphs, and which fused kernels the device stack
offers. General code (runner, model, layers) asks the platform or the backend it chose, never the
device type.
"""

from collections.abc import Callable

import torch
from torch import nn

from vllm.attention.backends.abstract import AttentionBackend
from vllm.compilation.regions import RegionStats
from vllm.config import EngineConfig
from vllm.platforms.cpu_threads import ThreadGovernor


class Platform:
    """Base class; one subclass per device type. Holds no per-step state."""

    device_type: str = "cpu"
    # Compute dtype chosen by dtype="auto".
    default_dtype: torch.dtype = torch.float32
    # Whether graph capture is off unless the user asks for it (enforce_eager=False).
    default_enforce_eager: bool = False
    # True: one compiled graph whose token dimension is symbolic serves every bucket.
    # False: one static graph per bucket, as device graph runtimes need.
    symbolic_token_count: bool = False
    # After warm-up, run only the guards that tell the captured graphs apart (dynamo raises
    # instead of compiling an unwarmed shape). Where an unwarmed shape must still run, counted
    # and logged (RegionStats), the guards stay.
    skip_guards_after_warmup: bool = False
    # True: gpu_memory_utilization sizes the KV cache from the device's free memory; False: the
    # KV cache takes kv_cache_memory_bytes (VLLM_CPU_KVCACHE_SPACE), as vLLM's CPU backend does.
    sizes_kv_cache_from_device_memory: bool = False
    # Smallest token bucket unless VLLM_TOKEN_BUCKET_MIN says otherwise (vllm/worker/bucketing.py).
    min_token_bucket: int = 16
    # torch.distributed backend of the tensor-parallel ranks.
    dist_backend: str = "gloo"
    # The Ray resource a rank's bundle of the placement group asks for, one unit a rank.
    ray_device_key: str = "CPU"
    # The `quantization` methods whose kernels this platform has.
    supported_quantization: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.region_stats = RegionStats()

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def auto_dtype(self, quantization: str | None, quantized_types: frozenset[str] = frozenset()) -> torch.dtype:
        """The compute dtype dtype="auto" means for weights in `quantization` (None: unquantized),
        of the quantized types named (a GGUF file's, such as "Q4_1")."""
        return self.default_dtype

    def kv_cache_budget(self, gpu_memory_utilization: float, weight_bytes: int) -> int:
        """Bytes for the KV cache when the user gives no kv_cache_memory_bytes, on platforms that
        size it from device memory (`sizes_kv_cache_from_device_memory`)."""
        raise NotImplementedError

    def gguf_kernel_types(self) -> frozenset[str]:
        """The GGUF quantized types ("Q4_1", ...) whose blocks this platform's kernels multiply: a
        .gguf model of only these types runs on its blocks unless told otherwise."""
        return frozenset()

    def configure_worker(self, world_size: int) -> None:
        """Settings of a worker process that runs one of `world_size` ranks on this host. The
        default: none."""

    def build_kernels(self) -> None:
        """Builds the platform's own kernels not built yet, before the model loads; the default:
        nothing to build."""

    def thread_governor(self) -> ThreadGovernor | None:
        """What adapts the host threads of this worker's kernels to the load of the machine,
        called before each step; the default: nothing (the device does the work)."""
        return None

    def synchronize(self) -> None:
        """Waits for queued device work (for timing)."""

    def mark_step(self) -> None:
        """Ends a lazily traced region (HPU lazy mode); a no-op on eager devices."""

    def attention_backend(self, config: EngineConfig, sliding_window: int | None) -> AttentionBackend:
        """The attention backend for this device."""
        raise NotImplementedError

    def capture_model(self, model: nn.Module) -> Callable:
        """The model's forward pass as the device captures it (see `symbolic_token_count`)."""
        raise NotImplementedError

    def capture_region(self, name: str, module: nn.Module) -> Callable:
        """`module` captured as a region of its own, its calls' signatures recorded under `name`
        in `region_stats`. The default runs it as it is, unrecorded (nothing is compiled)."""
        return module

    def fused_sdpa(self) -> Callable | None:
        """(q, k, v, additive mask, scale) -> attention, a fused device kernel, or None."""
        return None

    def fused_rms_norm(self) -> Callable | None:
        """(x, weight, eps) -> RMS norm, a fused device kernel, or None."""
        return None
