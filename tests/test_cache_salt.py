"""Cache salts (vLLM's `cache_salt`): requests share prefix-cache blocks only with requests of
the same salt, in the block manager, the engine, beam search and the server; tokens do not depend
on the salt; a bad salt is refused."""

import asyncio

import pytest

from tests.utils import random_prompts
from vllm import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from vllm.core.block_manager import BlockManager
from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.sampling_params import BeamSearchParams

BLOCK = 16


def test_blocks_are_found_only_with_the_salt_that_named_them():
    bm = BlockManager(16, 4, enable_caching=True)
    tokens = list(range(12))
    bm.allocate("named", [], 12)
    bm.cache_blocks("named", 12, lambda a, b: tokens[a:b], salt="tenant-a")
    for request, salt, expected in [("same", "tenant-a", 3), ("other", "tenant-b", 0), ("unsalted", None, 0)]:
        assert len(bm.cached_prefix(request, 12, lambda a, b: tokens[a:b], salt)) == expected, salt
    bm.free("named")
    bm.allocate("plain", [], 12)
    bm.cache_blocks("plain", 12, lambda a, b: tokens[a:b])
    assert len(bm.cached_prefix("again", 12, lambda a, b: tokens[a:b])) == 3
    assert len(bm.cached_prefix("salted", 12, lambda a, b: tokens[a:b], "tenant-a")) == 3  # its own blocks


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], dtype="float32", block_size=BLOCK, max_model_len=256,
               max_num_batched_tokens=64, enforce_eager=True, kv_cache_memory_bytes=16 * 2**20)


def _run(llm, token_ids, salt=None):
    prompt = {"prompt_token_ids": token_ids} | ({"cache_salt": salt} if salt is not None else {})
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]


def test_the_engine_shares_blocks_within_a_salt_only(llm):
    llm.reset_prefix_cache()
    [prompt] = random_prompts([70], seed=3)
    first = _run(llm, prompt, "a")
    hits = {salt: _run(llm, prompt, salt) for salt in ("a", "b", None)}
    assert hits["a"].num_cached_tokens == 4 * BLOCK  # the first's full blocks
    assert hits["b"].num_cached_tokens == hits[None].num_cached_tokens == 0
    outputs = {tuple(out.outputs[0].token_ids) for out in (first, *hits.values())}
    assert len(outputs) == 1  # the salt changes where the KV comes from, not the tokens
    for bad in ("", 7):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            _run(llm, prompt, bad)


def test_beam_search_keeps_the_salt(llm):
    llm.reset_prefix_cache()
    [prompt] = random_prompts([40], seed=4)
    engine = llm.llm_engine
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    llm.beam_search([{"prompt_token_ids": prompt, "cache_salt": "a"}], params)
    queries, hits = engine.scheduler.num_prefix_cache_queries, engine.scheduler.num_prefix_cache_hits
    assert _run(llm, prompt, "b").num_cached_tokens == 0  # nothing the search cached has another salt
    assert _run(llm, prompt, "a").num_cached_tokens == 2 * BLOCK
    assert engine.scheduler.num_prefix_cache_hits > hits and engine.scheduler.num_prefix_cache_queries > queries


def test_the_server_passes_the_salt_on(tiny_checkpoints):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(
        model=tiny_checkpoints["llama"], dtype="float32", max_model_len=256, block_size=BLOCK,
        enforce_eager=True, kv_cache_memory_bytes=16 * 2**20))
    scheduler = engine.engine.scheduler
    prompt = " ".join(["salt"] * 60)
    completions = OpenAIServingCompletion(engine, ["tiny"])
    chat = OpenAIServingChat(engine, ["tiny"])

    async def hits(salt, chat_request=False):
        before = scheduler.num_prefix_cache_hits
        if chat_request:
            await chat.create_chat_completion(ChatCompletionRequest(
                messages=[{"role": "user", "content": prompt}], max_tokens=1, cache_salt=salt))
        else:
            await completions.create_completion(CompletionRequest(prompt=prompt, max_tokens=1, cache_salt=salt))
        return scheduler.num_prefix_cache_hits - before

    async def main():
        assert await hits("a") == 0
        assert await hits("a") > 0 and await hits("b") == 0 and await hits(None) == 0
        assert await hits("c", chat_request=True) == 0
        assert await hits("c", chat_request=True) > 0 and await hits("a", chat_request=True) == 0
        await engine.shutdown()

    asyncio.run(main())
    with pytest.raises(ValueError, match="cache_salt"):
        CompletionRequest(prompt="hi", cache_salt="")
