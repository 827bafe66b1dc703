"""Admission without thrash: a waiting prompt starts only when the blocks of all its tokens fit
beside a watermark, so running decodes are not left to preempt it block by block."""

import logging

from tests.test_scheduler import FakeEngine, calls


def test_a_prompt_waits_until_all_its_blocks_fit():
    # 6 blocks of 4: a holds 2 and grows to 4; b's first chunk would fit beside it, its 20
    # tokens (5 blocks) do not.
    eng = FakeEngine(budget=8, num_blocks=6, block_size=4, max_model_len=24, max_num_partial_prefills=2)
    a = eng.add("a", 8, max_tokens=6)
    eng.add("b", 20, max_tokens=2)
    assert calls(eng.step()) == [("a", 8, 0)]
    while not a.is_finished:
        assert "b" not in [s.request_id for s in eng.step().scheduled]
    assert calls(eng.step()) == [("b", 8, 0)]
    eng.run()
    assert eng.sched.num_preemptions == 0


def test_with_nothing_running_a_prompt_that_fits_the_cache_starts():
    eng = FakeEngine(budget=8, num_blocks=5, block_size=4, max_model_len=24)
    eng.add("a", 20, max_tokens=1)  # all 5 blocks, no room for a watermark: still runs
    eng.run()
    assert eng.seqs["a"].is_finished and eng.sched.num_preemptions == 0


def test_long_prompts_in_a_tight_cache_are_preempted_at_most_once_each(caplog):
    """The issue's workload on the scheduler alone: 130 blocks of 16 hold two of the eight
    864-token requests at once. Admitted on their first chunk, they were preempted ~11 times each."""
    eng = FakeEngine(budget=256, max_num_seqs=64, num_blocks=130, block_size=16, max_model_len=2048)
    for i in range(8):
        eng.add(f"r{i}", 800 + 3 * i, max_tokens=64)
    with caplog.at_level(logging.WARNING):
        eng.run(max_steps=5000)
    assert all(s.is_finished and len(s.output_token_ids) == 64 for s in eng.seqs.values())
    assert eng.sched.num_preemptions <= 8
    # Computed tokens: every prompt and output once, plus what preemptions recomputed.
    computed = sum(o.num_batched_tokens for o in eng.outputs)
    assert computed <= 1.05 * sum(s.num_tokens for s in eng.seqs.values())


def test_preemptions_are_logged_as_vllm_does(caplog):
    # Two 4-token prompts fit 4 blocks of 4 until each needs a third: the newer one, b, yields.
    eng = FakeEngine(budget=64, max_model_len=16, num_blocks=4, block_size=4, max_num_partial_prefills=2)
    eng.add("a", 4, max_tokens=8)
    eng.add("b", 4, max_tokens=8)
    with caplog.at_level(logging.WARNING):
        eng.run()
    assert eng.sched.num_preemptions == 1
    assert "Request b is preempted" in caplog.text and "Preemptions so far: 1" in caplog.text


def test_the_engine_in_a_tight_cache_matches_a_roomy_one_with_few_preemptions(tiny_checkpoints):
    """The issue's workload, scaled down, end to end on the tiny Llama: 65 blocks of 16 hold two
    of the six ~430-token requests at a time. The same tokens as with room for all, at most one
    preemption a request, nothing recomputed beyond that. (Wall time on SmolLM2:
    benchmarks/benchmark_preemption.py.)"""
    from tests.utils import random_prompts
    from vllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": p} for p in random_prompts([400 + 3 * i for i in range(6)], seed=3)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    runs = {}
    for num_blocks in (65, 512):
        llm = LLM(tiny_checkpoints["llama"], dtype="float32", block_size=16, max_num_batched_tokens=128,
                  num_gpu_blocks_override=num_blocks, enforce_eager=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[num_blocks] = [o.outputs[0].token_ids for o in outs], llm.llm_engine.stats
    (tight, tight_stats), (roomy, roomy_stats) = runs[65], runs[512]
    assert tight == roomy
    assert roomy_stats.num_preemptions == 0 and tight_stats.num_preemptions <= len(prompts)
    assert tight_stats.num_prefill_tokens <= roomy_stats.num_prefill_tokens * 1.05
