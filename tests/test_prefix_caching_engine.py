"""Prefix caching end to end: float32 greedy tokens are the same with and without the cache, on
tiny models and SmolLM2, at several budgets, with shared prefixes of every length, preemption
and n > 1; what was read from the cache is reported per request and in the engine stats."""

import pytest

from tests.utils import random_prompts
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs

BLOCK = 16


def _prompts(seed: int = 0) -> list[list[int]]:
    """Prompts sharing nothing, 1 block, many blocks, a whole prompt, and a whole prompt that
    ends inside a block, with a base prompt of 150 tokens (9 full blocks of 16)."""
    base = random_prompts([150], seed=seed)[0]
    own = random_prompts([9, 30, 5, 20, 1], seed=seed + 1)
    return [
        base,
        own[0],                            # shares nothing
        base[:BLOCK] + own[1],             # 1 block
        base[:BLOCK + 3] + own[2],         # 1 block and a partial one
        base[:6 * BLOCK] + own[3],         # many blocks
        base[:9 * BLOCK],                  # a whole prompt of full blocks: its last is recomputed
        base,                              # the same prompt again
        base[:100] + own[4],               # 6 blocks, then differs inside the 7th
    ]


def _llm(path: str, caching: bool, budget: int, **kwargs) -> LLM:
    kwargs = {"max_num_seqs": 8, "max_model_len": 512, **kwargs}
    return LLM(path, dtype="float32", block_size=BLOCK, max_num_batched_tokens=budget, enforce_eager=True,
               enable_prefix_caching=caching, **kwargs)


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 8, n: int = 1):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _tokens(outs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _run_rounds(llm: LLM, prompts: list[list[int]], **kwargs) -> list:
    """The first prompt alone (so the others find it), then the rest together, then all again."""
    return [*_greedy(llm, prompts[:1], **kwargs), *_greedy(llm, prompts[1:], **kwargs),
            *_greedy(llm, prompts, **kwargs)]


@pytest.mark.parametrize("kind,budget", [("llama", 16), ("llama", 512), ("mistral", 64)])
def test_greedy_tokens_equal_without_the_cache(tiny_checkpoints, kind, budget):
    """Mistral's sliding window (96) is shorter than the longer cached prefixes."""
    prompts = _prompts()
    want = _tokens(_greedy(_llm(tiny_checkpoints[kind], False, budget), prompts))
    llm = _llm(tiny_checkpoints[kind], True, budget)
    outs = _run_rounds(llm, prompts)
    assert _tokens(outs) == want + want
    cached = [o.num_cached_tokens for o in outs]
    # First round: after the base prompt alone, each finds its shared whole blocks (the same
    # prompt again: all but the last block, whose last token gives the logits).
    assert cached[:8] == [0, 0, 16, 16, 96, 128, 144, 96]
    # Second round: every prompt was seen, so each finds all its full blocks but the last
    # token's (the lone 9-token prompt has none).
    assert cached[8:] == [144, 0, 32, 16, 112, 128, 144, 96]
    stats = llm.llm_engine.stats
    assert stats.num_prefix_cache_hits == sum(cached)
    assert stats.num_prefix_cache_queries == 2 * sum(map(len, prompts))
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_preemption_with_a_small_cache(tiny_checkpoints):
    """Too few blocks for the running requests: preempted requests find their own blocks (or
    shared ones) again when they were not evicted, and still generate the same tokens."""
    prompts = _prompts(seed=3)
    kwargs = dict(num_gpu_blocks_override=24, max_model_len=256)
    want = _tokens(_greedy(_llm(tiny_checkpoints["llama"], False, 64, **kwargs), prompts, max_tokens=40))
    llm = _llm(tiny_checkpoints["llama"], True, 64, **kwargs)
    assert _tokens(_greedy(llm, prompts, max_tokens=40)) == want
    stats = llm.llm_engine.stats
    assert stats.num_preemptions > 0 and stats.num_prefix_cache_hits > 0


def test_parallel_samples_with_a_cached_prefix(tiny_checkpoints):
    """n > 1 forks share blocks that came from the cache; every greedy sample equals the lone one."""
    prompts = _prompts(seed=5)[:5]
    path = tiny_checkpoints["llama"]
    want = _tokens(_greedy(_llm(path, False, 32), prompts))
    llm = _llm(path, True, 32)
    _greedy(llm, prompts[:1])
    outs = _greedy(llm, prompts, n=3)
    assert [o.num_cached_tokens for o in outs] == [144, 0, 16, 16, 96]
    assert all(samples == [w[0]] * 3 for samples, w in zip(_tokens(outs), want, strict=True))
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_prompt_logprobs_are_computed_even_when_cached(tiny_checkpoints):
    prompt = random_prompts([70], seed=7)[0]
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    path = tiny_checkpoints["llama"]
    want = _llm(path, False, 32).generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    llm = _llm(path, True, 32)
    _greedy(llm, [prompt])
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == len(prompt)
    for got, ref in zip(out.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
        assert got.keys() == ref.keys()
        assert all(abs(got[t].logprob - ref[t].logprob) < 1e-4 for t in got)
    assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_smollm2_greedy_tokens_equal_without_the_cache():
    """The real model (GQA, 30 layers): a shared system prompt, then a repeated question. One
    engine, to load the model once: the references run each prompt after `reset_prefix_cache`,
    so they compute every token."""
    system = "You are a helpful assistant who answers questions about geography briefly. " * 3
    prompts = [system + q for q in ("What is the capital of France?", "Name a river in Africa.")]
    prompts.append(prompts[0])
    params = SamplingParams(temperature=0, max_tokens=6)
    llm = LLM(dtype="float32", block_size=BLOCK, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4)
    want = []
    for prompt in prompts[:2]:
        assert llm.reset_prefix_cache()
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        want.append(out.outputs[0].token_ids)
    assert llm.reset_prefix_cache()
    outs = [*llm.generate(prompts[:1], params, use_tqdm=False), *llm.generate(prompts[1:], params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in outs] == [*want, want[0]]
    n = len(outs[0].prompt_token_ids)
    assert [o.num_cached_tokens for o in outs[::2]] == [0, (n - 1) // BLOCK * BLOCK]
    assert outs[1].num_cached_tokens >= 2 * BLOCK  # the system prompt's full blocks


def test_reset_prefix_cache_only_when_no_request_holds_blocks(tiny_checkpoints):
    llm = _llm(tiny_checkpoints["llama"], True, 64)
    prompt = random_prompts([40], seed=9)[0]
    _greedy(llm, [prompt])
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4))
    engine.step()
    assert not llm.reset_prefix_cache()
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache()
    assert _greedy(llm, [prompt])[0].num_cached_tokens == 0


def test_prefix_caching_is_on_by_default(tiny_checkpoints):
    assert EngineArgs().enable_prefix_caching
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", max_model_len=256, block_size=BLOCK)
    assert llm.llm_engine.scheduler.block_manager.enable_caching
    assert not _llm(tiny_checkpoints["llama"], False, 64).llm_engine.scheduler.block_manager.enable_caching
