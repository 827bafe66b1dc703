"""On Gaudi the KV cache takes what gpu_memory_utilization leaves of device memory after what is
in use and the weights (through the habana_frameworks test double, whose memory a test sets)."""

import glob
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vllm import EngineArgs
from vllm.model_executor.model_loader import (load_hf_config, model_weight_bytes,
                                             resolve_model_source)
from vllm.platforms.hpu import HpuPlatform

HPU_DOUBLE = Path(__file__).parent / "hpu_double"
GIB = 1024**3


@pytest.fixture
def device_memory(monkeypatch):
    """The double's (free, total) memory, as a dict the test sets."""
    monkeypatch.syspath_prepend(str(HPU_DOUBLE))
    from habana_frameworks.torch import hpu

    monkeypatch.setattr(hpu, "MEMORY", {"free": 2 * GIB, "total": 2 * GIB})
    yield hpu.MEMORY
    del sys.modules["habana_frameworks"]  # later tests must not find a Gaudi stack


def kv_bytes(path: str, **kwargs) -> int:
    config, _, _ = EngineArgs(model=path, dtype="bfloat16", **kwargs).create_engine_config(HpuPlatform())
    return config.cache.kv_cache_memory_bytes


def test_model_weight_bytes_counts_every_parameter_once(tiny_checkpoints):
    for kind in ("llama", "qwen2"):  # untied and tied embeddings
        path = tiny_checkpoints[kind]
        tensors = {k: v for f in glob.glob(f"{path}/*.safetensors") for k, v in load_file(f).items()}
        expected = sum(t.numel() for t in tensors.values()) * 2  # bf16
        assert model_weight_bytes(load_hf_config(resolve_model_source(path)), torch.bfloat16) == expected


def test_kv_cache_from_device_memory(tiny_checkpoints, device_memory):
    path = tiny_checkpoints["llama"]
    weights = model_weight_bytes(load_hf_config(resolve_model_source(path)), torch.bfloat16)
    device_memory.update(free=int(1.5 * GIB), total=2 * GIB)
    assert kv_bytes(path, gpu_memory_utilization=0.5) == GIB - GIB // 2 - weights
    assert kv_bytes(path) == int(2 * GIB * 0.9) - GIB // 2 - weights
    assert kv_bytes(path, kv_cache_memory_bytes=12345 * 1024) == 12345 * 1024  # an explicit budget wins
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.2 leaves no device memory"):
        kv_bytes(path, gpu_memory_utilization=0.2)
