"""Sampling: filters against a direct reference, and seeded streams independent of batching."""

import pytest
import torch

from tests.utils import random_prompts
from vllm import LLM, SamplingParams
from vllm.model_executor.layers.sampler import sample


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]])
    gens = [torch.Generator().manual_seed(0)] * 2
    assert sample(logits, [SamplingParams(temperature=0)] * 2, gens) == [1, 0]


def test_greedy_ties_go_to_the_first_index():
    """As transformers' argmax: a vocabulary-wide row of ties, and ties far apart."""
    logits = torch.randn(3, 49152)
    logits[0] = 1.0
    logits[1, [7, 30000, 49151]] = 100.0
    logits[2, [49150, 49151]] = 100.0
    gens = [torch.Generator().manual_seed(0)] * 3
    assert sample(logits, [SamplingParams(temperature=0)] * 3, gens) == [0, 7, 49150]


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.5), (5, 0.8), (1, 1.0)])
def test_samples_stay_inside_top_k_and_top_p(top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 3
    probs = logits.softmax(-1)[0]
    order = probs.argsort(descending=True).tolist()
    allowed, mass = [], 0.0
    for rank, tok in enumerate(order):  # reference: walk the sorted distribution
        if (top_k and rank >= top_k) or mass > top_p:
            break
        allowed.append(tok)
        mass += probs[tok].item()
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    gen = torch.Generator().manual_seed(1)
    seen = {sample(logits, [params], [gen])[0] for _ in range(400)}
    assert seen <= set(allowed)
    assert len(seen) == len(allowed) or len(allowed) > 20  # small sets are fully explored


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(logits, [SamplingParams(temperature=1.0)], [gen])[0]] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def _seeded(path: str, budget: int, prompts: list[list[int]], seeds: list[int]) -> list[list[int]]:
    llm = LLM(path, dtype="float32", max_model_len=512, block_size=16, max_num_batched_tokens=budget,
              max_num_seqs=min(budget, 8), enforce_eager=True)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=s, max_tokens=16) for s in seeds]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sampling_ignores_chunking_and_batch_mates(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    prompts = random_prompts([5, 40, 130, 77], seed=3)
    seeds = [11, 12, 13, 14]
    reference = _seeded(path, 2048, prompts, seeds)
    assert _seeded(path, 7, prompts, seeds) == reference
    # Alone, or with other (unseeded) requests around it, request 2 draws the same tokens.
    alone = _seeded(path, 16, [prompts[2]], [seeds[2]])
    assert alone == [reference[2]]
    llm_mixed = _seeded(path, 32, [prompts[2]] + random_prompts([60, 9], seed=4), [seeds[2], 99, 98])
    assert llm_mixed[0] == reference[2]
    assert len({tuple(r) for r in reference}) == len(reference)  # different seeds, different draws


def test_a_rows_draws_ignore_batch_mates_with_other_filters():
    torch.manual_seed(0)
    logits = torch.randn(2, 100)
    plain, filtered = SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=5, top_p=0.9)
    g_alone, g_mixed, g_other = (torch.Generator().manual_seed(s) for s in (5, 5, 6))
    alone = [sample(logits[:1], [plain], [g_alone])[0] for _ in range(30)]
    mixed = [sample(logits, [plain, filtered], [g_mixed, g_other])[0] for _ in range(30)]
    assert alone == mixed and len(set(alone)) > 5


def test_repetition_penalty_and_min_tokens_end_to_end_match_transformers(tiny_checkpoints):
    """transformers' RepetitionPenaltyLogitsProcessor and MinNewTokensLengthLogitsProcessor use
    the same rules (prompt and output tokens penalised; EOS masked until the minimum)."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints["llama"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", max_model_len=512, block_size=16, max_num_batched_tokens=16,
              enforce_eager=True)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    # Prompts that end with their own greedy continuation: the penalty has tokens to act on.
    prompts = [p + o.outputs[0].token_ids for p, o in zip(
        random_prompts([12, 70], seed=9),
        llm.generate([{"prompt_token_ids": p} for p in random_prompts([12, 70], seed=9)], greedy,
                     use_tqdm=False))]
    params = SamplingParams(temperature=0, repetition_penalty=1.8, min_tokens=20, max_tokens=24)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    for prompt, out, base in zip(prompts, outs, plain, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=24, repetition_penalty=1.8, min_new_tokens=20)
        expected = ref[0, len(prompt):].tolist()
        eos = model.generation_config.eos_token_id
        if eos in expected:
            expected = expected[:expected.index(eos) + 1]
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].token_ids != base.outputs[0].token_ids  # the penalty mattered


def _hf_generate(model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, **kwargs)[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    return out[:out.index(eos) + 1] if eos in out else out


def test_logit_bias_bad_words_and_allowed_ids_end_to_end_match_transformers(tiny_checkpoints):
    """transformers' SequenceBiasLogitsProcessor (one-token sequences), NoBadWordsLogitsProcessor
    and prefix_allowed_tokens_fn, given the ids the engine made of the same request, with
    prompts chunked at a 16-token budget."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints["llama"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", max_model_len=512, block_size=16, max_num_batched_tokens=16,
              enforce_eager=True)
    tokenizer = llm.get_tokenizer()
    prompts = random_prompts([12, 70], seed=9)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    plain = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]
    # From each plain output, a word of one token however it is tokenized.
    words = []
    for out in plain:
        for token in out:
            word = SamplingParams(bad_words=[tokenizer.decode([token]).strip() or "x"])
            word.update_from_tokenizer(tokenizer)
            if all(len(ids) == 1 for ids in word.bad_words_token_ids):
                words += word.bad_words
                break
    allowed = sorted({t for out in plain for t in out[::3]} | set(random_prompts([40], seed=2)[0]))
    cases = [
        (dict(logit_bias={plain[0][0]: -3.0, plain[1][2]: -2.0, 777: 4.0}),
         lambda p: dict(sequence_bias=[[[t], b] for t, b in p.logit_bias.items()])),
        (dict(bad_words=words), lambda p: dict(bad_words_ids=p.bad_words_token_ids)),
        (dict(allowed_token_ids=allowed), lambda p: dict(prefix_allowed_tokens_fn=lambda b, ids: allowed)),
    ]
    for fields, hf_kwargs in cases:
        params = SamplingParams(temperature=0, max_tokens=24, **fields)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        engine_params = params.clone()
        engine_params.update_from_tokenizer(tokenizer)
        for prompt, out, base in zip(prompts, outs, plain, strict=True):
            assert out.outputs[0].token_ids == _hf_generate(model, prompt, 24, **hf_kwargs(engine_params)), fields
            assert out.outputs[0].token_ids != base, fields  # the processor mattered


def test_forked_seeded_samples_keep_the_token_constraints(tiny_checkpoints):
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", max_model_len=256, block_size=16,
              max_num_batched_tokens=32, enforce_eager=True)
    allowed = list(range(1000, 1040))
    params = SamplingParams(n=3, seed=5, temperature=1.5, max_tokens=30, ignore_eos=True,
                            allowed_token_ids=allowed, logit_bias={1000: -100, 1001: 3.0, 1002: 6.0},
                            bad_words=[llm.get_tokenizer().decode([1002])])  # banned, whatever its bias
    out = llm.generate({"prompt_token_ids": random_prompts([20], seed=1)[0]}, params, use_tqdm=False)[0]
    tokens = [t for sample in out.outputs for t in sample.token_ids]
    assert len(out.outputs) == 3 and set(tokens) <= set(allowed) - {1000, 1002}
    assert 1001 in tokens and len(set(tokens)) > 5


def test_token_constraints_outside_the_model_are_refused_before_anything_runs(tiny_checkpoints):
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", max_model_len=256, enforce_eager=True)
    engine = llm.llm_engine
    vocab = engine.config.model.vocab_size
    bad = [(dict(logit_bias={vocab: 1.0}), r"logit_bias holds ids outside the model's vocabulary"),
           (dict(allowed_token_ids=[5, vocab + 3]), r"allowed_token_ids holds ids outside"),
           (dict(allowed_token_ids=[engine.eos_token_id], min_tokens=2), "allowed_token_ids leaves nothing"),
           (dict(allowed_token_ids=[7], stop_token_ids=[7], min_tokens=1), "allowed_token_ids leaves nothing"),
           (dict(allowed_token_ids=[engine.tokenizer.encode("hi", add_special_tokens=False)[0]],
                 bad_words=["hi"]), "allowed_token_ids leaves nothing")]
    for fields, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request("r", {"prompt_token_ids": [5, 6]}, SamplingParams(**fields))
        assert not engine.has_unfinished_requests()
    # The same ids are fine where they cannot empty a step.
    engine.add_request("ok", {"prompt_token_ids": [5, 6]},
                       SamplingParams(allowed_token_ids=[engine.eos_token_id, 9], min_tokens=2, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
