"""Loading: parameters are created in the run dtype, and a KV cache too small for one
max_model_len sequence is refused before any weight is read."""

import json
import shutil

import pytest
import torch

from vllm import LLM
from vllm.worker import worker
from vllm.model_executor.model_loader import load_hf_config, resolve_model_source
from vllm.model_executor.models.registry import resolve_model_class


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_parameters_are_created_in_the_run_dtype(tiny_checkpoints, dtype):
    hf_config = load_hf_config(resolve_model_source(tiny_checkpoints["qwen2"]))
    model = resolve_model_class(hf_config)(hf_config, max_position=64, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}  # never a float32 copy first


@pytest.fixture
def long_context_model(tiny_checkpoints, tmp_path) -> str:
    path = tmp_path / "long"
    shutil.copytree(tiny_checkpoints["llama"], path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 131072
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_too_small_kv_cache_fails_before_the_weights_load(long_context_model, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the KV cache was checked")
    monkeypatch.setattr(worker, "load_model", refuse)
    # 2 layers x (K + V) x 2 KV heads x head_dim 16 x 4 bytes = 512 bytes a token; 8 KiB a block.
    with pytest.raises(ValueError) as error:
        LLM(long_context_model, dtype="float32", block_size=16, kv_cache_memory_bytes=1024**2)
    message = str(error.value)
    assert "holds 2048 tokens (128 blocks of 16 tokens, 0.01 MiB each in torch.float32)" in message
    assert "max_model_len=131072" in message
    assert "kv_cache_memory_bytes to at least 67108864 (VLLM_CPU_KVCACHE_SPACE=1 GiB)" in message
    assert "lower max_model_len to at most 2048" in message
    with pytest.raises(ValueError, match="num_gpu_blocks_override to at least 8192"):
        LLM(long_context_model, dtype="float32", block_size=16, num_gpu_blocks_override=100)
