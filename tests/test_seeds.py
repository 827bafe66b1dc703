"""The scripts and commands of the documents users come from (shared/seeds/), run unchanged but
for the model path (a tiny random Llama) and, where they take sizes, smaller sizes.

- 000 (beginner's demo README): its `LLM(...)` configuration, the sync demo's mixed prompts and
  the async demo's large and small requests served together.
- 001 (evaluation pipeline): the chunked-prefill knobs it lists, passed to `LLM(...)`.
- 003 (deep dive): the engine flags of its server commands and the log lines it quotes; the
  server itself is `vllm serve` (issue 19), and `--data-parallel-size 2 --tensor-parallel-size 2`
  needs the distributed executor (issue 22): refused with the argument named.
- 004 (the Gaudi fork's README): `LLM(model=model, enable_chunked_prefill=True)` and its
  benchmark_throughput.py command.
- 002 (a course chapter) uses no vLLM API: nothing to run.
"""

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys

import pytest

from vllm import LLM, AsyncEngineArgs, AsyncLLMEngine, SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def small_kv_cache(monkeypatch):
    """The seeds leave the KV cache at its default size; the tiny model needs far less."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.0625")


@pytest.fixture
def model(tiny_checkpoints) -> str:
    return tiny_checkpoints["llama"]


def long_prompt(llm_or_tokenizer, num_tokens: int) -> str:
    tokenizer = getattr(llm_or_tokenizer, "get_tokenizer", lambda: llm_or_tokenizer)()
    text = "Please analyze the following text in detail. " + "The quick brown fox jumps. " * num_tokens
    return tokenizer.decode(tokenizer(text).input_ids[:num_tokens])


def test_seed_000_sync_demo(model):
    llm = LLM(
        model=model,
        enable_chunked_prefill=True,        # Enable the feature
        max_num_batched_tokens=2048,        # Total batch size
        max_num_seqs=256,                   # Max concurrent requests
        gpu_memory_utilization=0.9,         # Memory usage limit
    )
    prompts = ["What is AI?", "Explain machine learning in detail, with examples of supervised "
               "and unsupervised learning.", "Hello", long_prompt(llm, 300)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16))
    assert [o.prompt for o in outputs] == prompts
    assert all(o.finished and 1 <= len(o.outputs[0].token_ids) <= 16 for o in outputs)


def test_seed_000_async_demo(model):
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=model, enable_chunked_prefill=True, max_num_batched_tokens=2048, max_num_seqs=256,
        gpu_memory_utilization=0.9))
    tokenizer = engine.engine.tokenizer
    requests = {"large_1": long_prompt(tokenizer, 900), "small_1": "What is 2+2?",
                "small_2": "Hello, how are you?", "small_3": "Translate 'hello' to French",
                "large_2": long_prompt(tokenizer, 700)}

    async def one(request_id: str, prompt: str):
        final = None
        async for output in engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True),
                                            request_id):
            final = output
        return final

    async def main():
        return await asyncio.gather(*(one(rid, p) for rid, p in requests.items()))

    outputs = asyncio.run(main())
    assert [o.request_id for o in outputs] == list(requests)
    assert all(o.finished and len(o.outputs[0].token_ids) == 8 for o in outputs)


def test_seed_001_chunked_prefill_knobs(model):
    llm = LLM(model, enable_chunked_prefill=True, long_prefill_token_threshold=2048,
              max_num_partial_prefills=4, max_long_partial_prefills=2, disable_chunked_mm_input=False)
    config = llm.llm_engine.config.scheduler
    assert (config.long_prefill_token_threshold, config.max_num_partial_prefills) == (2048, 4)
    outputs = llm.generate(["short one", long_prompt(llm, 600)], SamplingParams(max_tokens=4))
    assert all(o.finished for o in outputs)


def test_seed_003_server_engine_flags(model, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)  # to caplog's handler
    parser = AsyncEngineArgs.add_cli_args(argparse.ArgumentParser())
    with caplog.at_level(logging.INFO):
        engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs.from_cli_args(
            parser.parse_args(["--model", model, "--max-num-batched-tokens", "512"])))
    assert "Chunked prefill is enabled with max_num_batched_tokens=512." in caplog.text
    assert engine.engine.config.scheduler.max_num_batched_tokens == 512
    args = AsyncEngineArgs.from_cli_args(parser.parse_args(
        ["--model", model, "--data-parallel-size", "2", "--tensor-parallel-size", "2"]))
    with pytest.raises(ValueError, match="data_parallel_size=2 .*vllm serve --data-parallel-size"):
        AsyncLLMEngine.from_engine_args(args)


def test_seed_004_llm(model):
    llm = LLM(
        model=model,
        enable_chunked_prefill=True,
    )
    assert llm.generate("Hello", SamplingParams(max_tokens=4))[0].finished


def test_seed_004_benchmark_throughput_command(model, tmp_path):
    out = tmp_path / "throughput.json"
    command = (f"benchmarks/benchmark_throughput.py --model {model} --trust-remote-code "
               "--enforce-eager --num-prompts 4  --input-len 64 --output-len 4 "
               "--max-num-batched-tokens 4096 --max-num-seqs 128 --enable-chunked-prefill")
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, *command.split(), "--output-json", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Throughput:" in proc.stdout
    result = json.loads(out.read_text())
    assert result["num_requests"] == 4 and result["total_num_tokens"] == 4 * (64 + 4)
    assert result["args"]["trust_remote_code"] and result["args"]["enable_chunked_prefill"]
