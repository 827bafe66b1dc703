"""Graph mode: every bucket warmed up, nothing compiled after, same tokens as eager."""

import random

import pytest
import torch._dynamo

from tests.utils import random_prompts
from vllm import LLM, SamplingParams
from vllm.model_executor.layers import cpu_tile_gemm
from vllm.platforms.cpu import CpuPlatform


def _workload(seed: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 232) for _ in range(14)]  # up to max_model_len with the outputs
    prompts = [{"prompt_token_ids": p} for p in random_prompts(lengths, seed=seed)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 24)) for _ in lengths]
    return prompts, params


def _run(path: str, enforce_eager: bool):
    # A cache of 24 blocks x 16 tokens for up to 8 sequences of up to 224 tokens forces preemption.
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=16, num_gpu_blocks_override=24,
              max_num_batched_tokens=64, max_num_seqs=8, enforce_eager=enforce_eager)
    prompts, params = _workload(7)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm.llm_engine, [o.outputs[0].token_ids for o in outs]


def test_no_compile_after_warmup_and_same_tokens_as_eager(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    eager_engine, eager = _run(path, enforce_eager=True)
    # Compiled code is cached per function for the whole process; start from an empty cache so
    # this engine's warm-up count is its own.
    torch._dynamo.reset()
    engine, graphs = _run(path, enforce_eager=False)
    stats = engine.graph_stats
    assert stats.enabled and stats.buckets == [2, 4, 8, 16, 32, 64]
    # CPU: one graph, its token count symbolic, serves every bucket.
    assert stats.graphs_compiled_at_warmup == 1
    assert stats.compiles_after_warmup == 0 and stats.unwarmed_steps == 0
    assert engine.stats.num_preemptions > 0
    assert 0 < stats.padding_overhead < 1.0
    assert graphs == eager
    assert not eager_engine.graph_stats.enabled


def test_size_one_bucket_gets_its_own_graph(tiny_checkpoints, monkeypatch):
    monkeypatch.setenv("VLLM_TOKEN_BUCKET_MIN", "1")
    torch._dynamo.reset()
    engine, _ = _run(tiny_checkpoints["llama"], enforce_eager=False)
    stats = engine.graph_stats
    assert stats.buckets == [1, 2, 4, 8, 16, 32, 64]
    # Dynamo specializes size 1, so the symbolic graph covers 2..64 and size 1 has its own.
    assert stats.graphs_compiled_at_warmup == 2
    assert stats.compiles_after_warmup == 0 and stats.unwarmed_steps == 0


def test_static_capture_has_one_graph_per_bucket(tiny_checkpoints, monkeypatch):
    """The capture device graph runtimes use (HPU): static shapes, one graph per bucket."""
    monkeypatch.setattr(CpuPlatform, "symbolic_token_count", False)
    torch._dynamo.reset()
    engine, _ = _run(tiny_checkpoints["llama"], enforce_eager=False)
    stats = engine.graph_stats
    assert stats.graphs_compiled_at_warmup == len(stats.buckets) == 6
    assert stats.compiles_after_warmup == 0 and stats.unwarmed_steps == 0


def test_bf16_graphs_call_the_packed_ops_at_run_time(tiny_checkpoints, monkeypatch):
    """bf16 on CPU packs the linear layers: inside the graph they are the opaque
    `vllm::packed_linear` and `vllm::silu_mul_linear` ops, which pick the tile GEMM (and its
    SiLU-and-multiply epilogue) at run time, so the one graph still serves every bucket."""
    if cpu_tile_gemm.max_rows() == 0:
        pytest.skip("the CPU has neither AMX nor AVX512-BF16: no tile copies")
    calls = []
    fused = cpu_tile_gemm.gemm_silu_mul
    monkeypatch.setattr(cpu_tile_gemm, "gemm_silu_mul", lambda *a: calls.append(a[0].shape[0]) or fused(*a))
    torch._dynamo.reset()
    llm = LLM(tiny_checkpoints["llama"], dtype="bfloat16", max_model_len=256, block_size=16,
              num_gpu_blocks_override=24, max_num_batched_tokens=64, max_num_seqs=8, enforce_eager=False)
    warmup_calls = len(calls)
    prompts, params = _workload(7)
    llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.graph_stats
    assert stats.graphs_compiled_at_warmup == 1 and stats.compiles_after_warmup == 0
    assert warmup_calls > 0 and len(calls) > warmup_calls  # the epilogue ran in the graph's steps
