import functools

import torch

from vllm.platforms.interface import Platform


def cpu_has_amx_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


class CpuPlatform(Platform):
    device_type = "cpu"
    # Measured on the 2-core AMX machine (benchmarks/results/graphs.json): captured regions run
    # prefill ~1.07x faster but decode ~0.87x (the per-call cost of compiled regions exceeds the
    # element-wise fusion they buy for a 135M model), so graphs are opt-in on CPU.
    default_enforce_eager = True

    def __init__(self) -> None:
        # bf16 runs on AMX/AVX512-bf16 tiles at several times the fp32 rate; without them fp32 is
        # the safer default.
        self.default_dtype = torch.bfloat16 if cpu_has_amx_bf16() else torch.float32

    def compile_fn(self):
        # Inductor generates C++ kernels that fuse the norms, rotary and activation
        # element-wise ops around the GEMMs; shapes stay static, one graph per bucket.
        return functools.partial(torch.compile, dynamic=False, fullgraph=True)
