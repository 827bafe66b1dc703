"""Intel Gaudi. `habana_frameworks` is imported here only, and only when this platform is chosen.

Gaudi runs PyTorch in one of two modes, and captures graphs differently in each:

    lazy mode (PT_HPU_LAZY_MODE=1)   ops are queued and compiled as one graph up to each
                                     `mark_step`, looked up by its ops and shapes; regions are
                                     HPU graphs (`wrap_in_hpu_graph`), replayed per input shapes
    eager/compile mode               ops run one by one, each compiled per shape; regions are
                                     compiled by `torch.compile(backend="hpu_backend")`

In both, every shape a step shows must have been shown at warm-up. The model body is captured
piecewise between attention calls (vllm/compilation/piecewise.py) in compile mode, and split by
the attention backend's `mark_step`s in lazy mode; attention is captured by the HPU attention
backend in regions keyed by its buckets (vllm/attention/backends/hpu_attn.py).
"""

import importlib
import importlib.util

import torch

from vllm.compilation.piecewise import PiecewiseBackend
from vllm.compilation.regions import CapturedRegion
from vllm.logger import init_logger
from vllm.platforms.interface import Platform

logger = init_logger(__name__)

_MAX_REGION_KEYS = 1024  # far above the keys of a region warm-up enumerates


def hpu_stack_installed() -> bool:
    return importlib.util.find_spec("habana_frameworks") is not None


def _optional(module: str, name: str):
    """`module.name` from the Gaudi stack, or None where this version lacks it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


class HpuPlatform(Platform):
    device_type = "hpu"
    default_dtype = torch.bfloat16
    # Up to about a hundred rows, a layer's matmuls on Gaudi take the time of reading their
    # weights, so padding a few decodes to 128 tokens costs little and saves graphs (prompts are
    # bucketed from a 128-token block on Gaudi too).
    min_token_bucket = 128
    dist_backend = "hccl"  # Habana's collectives library
    ray_device_key = "HPU"
    sizes_kv_cache_from_device_memory = True
    # No quantized kernels yet (Gaudi's users serve fp8, a later step): unquantized weights only.
    supported_quantization = ()

    def __init__(self) -> None:
        super().__init__()
        if not hpu_stack_installed():
            raise ValueError("device='hpu' needs the Intel Gaudi software stack (habana_frameworks), "
                             "which is not installed; use device='cpu'")
        import habana_frameworks.torch.core as htcore  # registers the "hpu" device and hpu_backend
        import habana_frameworks.torch.hpu as hthpu
        from habana_frameworks.torch.utils.internal import is_lazy

        self._htcore, self._hthpu = htcore, hthpu
        if not hthpu.is_available():
            raise ValueError("device='hpu' was requested but no Gaudi device is visible")
        self.lazy = bool(is_lazy())
        logger.info("Gaudi in %s mode", "lazy" if self.lazy else "eager/compile")
        sdpa = _optional("habana_frameworks.torch.hpex.kernels", "FusedSDPA")
        rms_norm = _optional("habana_frameworks.torch.hpex.normalization", "FusedRMSNorm")
        self._sdpa = None if sdpa is None else (
            lambda q, k, v, bias, scale: sdpa.apply(q, k, v, bias, 0.0, False, scale))
        self._rms_norm = None if rms_norm is None else (lambda x, weight, eps: rms_norm.apply(x, weight, eps))

    def kv_cache_budget(self, gpu_memory_utilization: float, weight_bytes: int) -> int:
        """The share `gpu_memory_utilization` of device memory, less what is already in use and
        the weights still to load. Activations and captured graphs come out of what the share
        leaves free, so a lower gpu_memory_utilization makes room for them."""
        free, total = self._hthpu.mem_get_info()
        budget = int(total * gpu_memory_utilization) - (total - free) - weight_bytes
        gib = 1024**3
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization={gpu_memory_utilization} leaves no device memory for the "
                f"KV cache: {total / gib:.2f} GiB in all, {(total - free) / gib:.2f} GiB in use, "
                f"{weight_bytes / gib:.2f} GiB of weights. Raise gpu_memory_utilization or pass "
                "kv_cache_memory_bytes.")
        logger.info("KV cache budget: %.2f GiB (gpu_memory_utilization=%s of %.2f GiB, %.2f GiB "
                    "in use, %.2f GiB of weights)", budget / gib, gpu_memory_utilization,
                    total / gib, (total - free) / gib, weight_bytes / gib)
        return budget

    def synchronize(self) -> None:
        self._hthpu.synchronize()

    def mark_step(self) -> None:
        if self.lazy:
            self._htcore.mark_step()

    def attention_backend(self, config, sliding_window):
        from vllm.attention.backends.hpu_attn import HpuAttentionBackend

        return HpuAttentionBackend(config, sliding_window, self.device, self)

    def capture_model(self, model):
        if self.lazy:
            # The attention backend's mark_steps cut the body into lazy graphs keyed by the token
            # count; the stack caches each. Recorded here per token count.
            return CapturedRegion("model", model, self.region_stats)
        backend = PiecewiseBackend(self._device_backend(), self.region_stats)
        return torch.compile(model, backend=backend, dynamic=False, fullgraph=True)

    def capture_region(self, name, module):
        if not self.lazy:
            # A region compiles once per bucket key, all of them at warm-up, which checks that no
            # key is left for later (RegionStats): dynamo's default caps would fall back to eager.
            from torch._dynamo import config as dynamo_config

            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _MAX_REGION_KEYS)
            dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit,
                                                            4 * _MAX_REGION_KEYS)
        if self.lazy:
            captured = self._hthpu.wrap_in_hpu_graph(module)
        else:
            captured = torch.compile(module, backend="hpu_backend", dynamic=False, fullgraph=True)
        return CapturedRegion(name, captured, self.region_stats)

    def _device_backend(self):
        from torch._dynamo import lookup_backend

        return lookup_backend("hpu_backend")

    def fused_sdpa(self):
        return self._sdpa

    def fused_rms_norm(self):
        return self._rms_norm
