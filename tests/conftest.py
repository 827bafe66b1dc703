"""Shared fixtures: tiny random Hugging Face checkpoints built on the spot, and the real model."""

import json
import os

import pytest
import torch

from tests.utils import build_tiny_checkpoint, smollm2_tokenizer

# Tests compare tokens across runs, and a product's summation order may follow the thread count:
# the count stays fixed here, except in tests/test_cpu_threads.py, which turns adaptation on.
os.environ.setdefault("VLLM_CPU_ADAPTIVE_THREADS", "0")
# Every engine zeroes its whole KV cache when built: the tests' hundreds of engines keep 0.5 GiB
# (a SmolLM2 sequence of its full 8,192 tokens in float32 needs 0.35) instead of the default.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "0.5")
# Set for a subprocess that runs tests (as another kind of CPU, or sanitized): the files of the
# two session fixtures below, which it takes instead of building them again (`tiny_files_env`).
TINY_FILES = "VLLM_TEST_TINY_FILES"


def _given_tiny_files() -> dict[str, str] | None:
    given = os.environ.get(TINY_FILES)
    return json.loads(given) if given else None


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """SmolLM2's tokenizer (from the GGUF), saved as plain Hugging Face files for the tiny models."""
    if (given := _given_tiny_files()) is not None:
        return given["tokenizer"]
    out = tmp_path_factory.mktemp("tokenizer")
    smollm2_tokenizer().save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    """model_type -> directory of a tiny random checkpoint (Llama GQA, Qwen2 with bias, Mistral)."""
    if (given := _given_tiny_files()) is not None:
        return {kind: given[kind] for kind in ("llama", "qwen2", "mistral")}
    root = tmp_path_factory.mktemp("tiny")
    return {kind: build_tiny_checkpoint(kind, str(root / kind), tokenizer_dir)
            for kind in ("llama", "qwen2", "mistral")}


@pytest.fixture
def tiny_files_env(tokenizer_dir, tiny_checkpoints) -> dict[str, str]:
    """Environment entries that hand the tokenizer and checkpoints to a subprocess running tests."""
    return {TINY_FILES: json.dumps({"tokenizer": tokenizer_dir, **tiny_checkpoints})}


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.manual_seed(0)
    yield
