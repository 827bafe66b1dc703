"""Shared fixtures: tiny random Hugging Face checkpoints built on the spot, and the real model."""

import os

import pytest
import torch

from tests.utils import build_tiny_checkpoint, smollm2_path

# Tests compare tokens across runs, and a product's summation order may follow the thread count:
# the count stays fixed here, except in tests/test_cpu_threads.py, which turns adaptation on.
os.environ.setdefault("VLLM_CPU_ADAPTIVE_THREADS", "0")
# Every engine zeroes its whole KV cache when built: the tests' hundreds of engines keep 0.5 GiB
# (a SmolLM2 sequence of its full 8,192 tokens in float32 needs 0.35) instead of the default.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "0.5")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """SmolLM2's tokenizer (from the GGUF), saved as plain Hugging Face files for the tiny models."""
    from transformers import AutoTokenizer

    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    out = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    """model_type -> directory of a tiny random checkpoint (Llama GQA, Qwen2 with bias, Mistral)."""
    root = tmp_path_factory.mktemp("tiny")
    return {kind: build_tiny_checkpoint(kind, str(root / kind), tokenizer_dir)
            for kind in ("llama", "qwen2", "mistral")}


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.manual_seed(0)
    yield
