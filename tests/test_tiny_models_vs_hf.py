"""End to end, float32: greedy tokens equal transformers' at every chunk budget and block size."""

import functools

import pytest

from tests.utils import hf_greedy, random_prompts
from vllm import LLM, SamplingParams

# Lengths chosen so that chunk budgets and block sizes do not divide them.
PROMPT_LENGTHS = [1, 7, 16, 17, 45, 129, 200, 300]
MAX_TOKENS = 32


@functools.cache
def _reference(path: str) -> tuple:
    return tuple(map(tuple, hf_greedy(path, random_prompts(PROMPT_LENGTHS), MAX_TOKENS)))


def _generate(path: str, enforce_eager: bool = True, **engine_kwargs) -> list[list[int]]:
    llm = LLM(path, dtype="float32", max_model_len=512, enforce_eager=enforce_eager, **engine_kwargs)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(PROMPT_LENGTHS)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("budget", [4, 16, 64, 2048])
@pytest.mark.parametrize("block_size", [16, 128])
def test_greedy_matches_transformers(tiny_checkpoints, kind, budget, block_size):
    path = tiny_checkpoints[kind]
    got = _generate(path, enable_chunked_prefill=True, max_num_batched_tokens=budget,
                    max_num_seqs=min(budget, 8), block_size=block_size)
    assert [tuple(g) for g in got] == list(_reference(path))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_graph_mode_matches_transformers(tiny_checkpoints, kind):
    path = tiny_checkpoints[kind]
    got = _generate(path, enforce_eager=False, max_num_batched_tokens=48, max_num_seqs=8, block_size=16)
    assert [tuple(g) for g in got] == list(_reference(path))


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_unchunked_matches_chunked(tiny_checkpoints, kind):
    path = tiny_checkpoints[kind]
    unchunked = _generate(path, enable_chunked_prefill=False, max_num_batched_tokens=512, block_size=16)
    chunked = _generate(path, enable_chunked_prefill=True, max_num_batched_tokens=24, block_size=16)
    assert unchunked == chunked == [list(r) for r in _reference(path)]


def test_tiny_cache_forces_preemption_and_still_matches(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    llm = LLM(path, dtype="float32", max_model_len=512, block_size=16, num_gpu_blocks_override=34,
              max_num_batched_tokens=64, max_num_seqs=8, enforce_eager=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(PROMPT_LENGTHS)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert llm.llm_engine.stats.num_preemptions > 0
    assert [tuple(o.outputs[0].token_ids) for o in outs] == list(_reference(path))
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
