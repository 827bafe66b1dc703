"""n > 1: samples share the prompt's KV blocks and are each reproducible on their own."""

import pytest

from tests.utils import random_prompts
from vllm import LLM, SamplingParams


def _llm(path: str, budget: int = 32, **kwargs) -> LLM:
    kwargs = {"max_num_seqs": 16, "block_size": 16, "max_model_len": 512, **kwargs}
    return LLM(path, dtype="float32", max_num_batched_tokens=budget, enforce_eager=True, **kwargs)


def _used(llm: LLM) -> int:
    bm = llm.llm_engine.scheduler.block_manager
    return bm.num_blocks - bm.num_free_blocks


# (prompt length, blocks in use once each of 4 samples wrote its first token, 16-token blocks):
#   40 tokens: blocks 0-1 shared, partial block 2 kept by sample 0 and copied for the 3 others
#   48 tokens: blocks 0-2 shared, each sample opens a block of its own for position 48
@pytest.mark.parametrize("prompt_len,expected_used", [(40, 3 + 3), (48, 3 + 4)])
def test_samples_share_the_prompt_blocks(tiny_checkpoints, prompt_len, expected_used):
    llm = _llm(tiny_checkpoints["llama"], budget=64)
    engine = llm.llm_engine
    bm = engine.scheduler.block_manager
    prompt = random_prompts([prompt_len], seed=1)[0]
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=6, ignore_eos=True))
    outs = engine.step()  # the whole prompt: 4 first tokens from one row of logits
    assert len(outs) == 1 and [len(c.token_ids) for c in outs[0].outputs] == [1, 1, 1, 1]
    engine.step()  # each sample writes its first token
    tables = [bm.block_table(f"{i}_r") for i in range(4)]
    shared = tables[0][:prompt_len // 16]
    assert all(t[:len(shared)] == shared for t in tables)
    assert all(bm.ref_count(b) == 4 for b in shared)
    assert _used(llm) == expected_used
    assert _used(llm) < 4 * bm.num_blocks_for(prompt_len + 1)  # what 4 separate requests hold
    while engine.has_unfinished_requests():
        engine.step()
    assert bm.num_free_blocks == bm.num_blocks


def test_greedy_samples_all_equal_the_single_sample(tiny_checkpoints):
    llm = _llm(tiny_checkpoints["llama"])
    prompts = [{"prompt_token_ids": p} for p in random_prompts([40, 7, 90], seed=2)]
    single = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    multi = llm.generate(prompts, SamplingParams(n=3, temperature=0, max_tokens=12), use_tqdm=False)
    for one, many in zip(single, multi, strict=True):
        assert [c.index for c in many.outputs] == [0, 1, 2]
        assert all(c.token_ids == one.outputs[0].token_ids for c in many.outputs)
        assert all(c.text == one.outputs[0].text for c in many.outputs)


def _seeded_samples(llm: LLM, prompts, n: int, seed: int) -> list[list[list[int]]]:
    params = SamplingParams(n=n, temperature=0.8, top_p=0.9, top_k=50, seed=seed, max_tokens=10,
                            ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_seeded_samples_are_reproducible_one_by_one(tiny_checkpoints):
    """Sample i of a seeded request draws what a lone request with seed + i draws, at any budget."""
    path = tiny_checkpoints["llama"]
    prompts = random_prompts([35, 130], seed=3)
    big = _llm(path, budget=2048)
    together = _seeded_samples(big, prompts, n=3, seed=100)
    alone = [[_seeded_samples(big, [p], n=1, seed=100 + i)[0][0] for i in range(3)] for p in prompts]
    assert together == alone
    assert len({tuple(s) for s in together[0]}) == 3  # the samples do differ
    assert _seeded_samples(_llm(path, budget=7, max_num_seqs=7), prompts, n=3, seed=100) == together


def test_forks_under_block_pressure_recompute_and_agree(tiny_checkpoints):
    """A cache too small for every sample: forks that find no block, and preempted samples,
    recompute their prompt; the tokens stay those of a roomy cache, and every block comes back."""
    path = tiny_checkpoints["llama"]
    prompts = random_prompts([60, 45, 33, 70], seed=4)
    roomy = _seeded_samples(_llm(path, budget=16), prompts, n=3, seed=7)
    tight = _llm(path, budget=16, num_gpu_blocks_override=16, max_model_len=256)
    assert _seeded_samples(tight, prompts, n=3, seed=7) == roomy
    assert tight.llm_engine.stats.num_preemptions > 0
    bm = tight.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_n_above_max_num_seqs_is_refused_and_abort_frees_all(tiny_checkpoints):
    llm = _llm(tiny_checkpoints["llama"], max_num_seqs=4)
    out = llm.generate("hello", SamplingParams(n=5, max_tokens=3), use_tqdm=False)[0]
    assert out.finished and "max_num_seqs" in out.error and all(c.token_ids == [] for c in out.outputs)
    engine = llm.llm_engine
    engine.add_request("x", {"prompt_token_ids": random_prompts([50])[0]}, SamplingParams(n=3, max_tokens=50))
    for _ in range(4):
        engine.step()
    engine.abort_request("x")
    assert not engine.has_unfinished_requests()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
