"""logprobs and prompt_logprobs against log_softmax of transformers' logits, at any chunking."""

import pytest
import torch

from tests.utils import hf_model, random_prompts, smollm2_path
from vllm import LLM, SamplingParams

TOL = 1e-4  # float32 end to end
K_SAMPLE, K_PROMPT = 3, 2


def _hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), V): row p is the distribution of the token after position p."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def _check_entry(entry: dict, token: int, ref_row: torch.Tensor, k: int) -> None:
    """One position's dict: the chosen token and the top-k, each with logprob and rank."""
    assert abs(entry[token].logprob - ref_row[token].item()) < TOL
    # The rank counts the tokens at least as likely; near-equal neighbours may swap by rounding.
    lp = ref_row[token].item()
    assert int((ref_row > lp + TOL).sum()) + 1 <= entry[token].rank <= int((ref_row >= lp - TOL).sum())
    top = ref_row.topk(k)
    for rank, (value, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
        assert entry[tid].rank == rank and abs(entry[tid].logprob - value) < TOL
    assert set(entry) == set(top.indices.tolist()) | {token}


def _run(path: str, budget: int, prompts: list[list[int]], max_tokens: int, **kwargs):
    llm = LLM(path, dtype="float32", max_num_batched_tokens=budget, max_num_seqs=min(budget, 8),
              block_size=16, max_model_len=512, enforce_eager=True, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=K_SAMPLE,
                            prompt_logprobs=K_PROMPT, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _check_against(model, outs) -> None:
    for out in outs:
        prompt, completion = out.prompt_token_ids, out.outputs[0]
        ref = _hf_logprobs(model, prompt + completion.token_ids)
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        for p in range(1, len(prompt)):
            _check_entry(plp[p], prompt[p], ref[p - 1], K_PROMPT)
        assert len(completion.logprobs) == len(completion.token_ids)
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            _check_entry(entry, token, ref[len(prompt) + j - 1], K_SAMPLE)
        total = sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs))
        assert abs(completion.cumulative_logprob - total) < 1e-6


def _flat(outs) -> list[float]:
    values = []
    for out in outs:
        for entry in out.prompt_logprobs[1:] + out.outputs[0].logprobs:
            values += [lp.logprob for _, lp in sorted(entry.items())]
    return values


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_tiny_models_match_transformers_at_every_budget(tiny_checkpoints, kind):
    path = tiny_checkpoints[kind]
    model = hf_model(path)
    prompts = random_prompts([37, 1, 2, 150, 64], seed=7)
    results = {}
    for budget in (4, 16, 2048):
        outs = _run(path, budget, prompts, max_tokens=5)
        _check_against(model, outs)
        results[budget] = outs
    # Chunking changes nothing: same tokens, same dict keys, values equal to rounding.
    for budget in (4, 16):
        assert [o.outputs[0].token_ids for o in results[budget]] == \
               [o.outputs[0].token_ids for o in results[2048]]
        a, b = _flat(results[budget]), _flat(results[2048])
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-5


def test_prompt_logprobs_survive_preemption(tiny_checkpoints):
    """A tiny cache forces recomputation; prompt logprobs are neither lost nor duplicated."""
    path = tiny_checkpoints["llama"]
    model = hf_model(path)
    prompts = random_prompts([120, 100, 90, 70], seed=8)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16, max_num_seqs=4, block_size=16,
              max_model_len=256, enforce_eager=True, num_gpu_blocks_override=16)
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.stats.num_preemptions > 0
    for out in outs:
        ref = _hf_logprobs(model, out.prompt_token_ids + out.outputs[0].token_ids)
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        for p in range(1, len(out.prompt_token_ids)):
            _check_entry(out.prompt_logprobs[p], out.prompt_token_ids[p], ref[p - 1], 1)


def test_sampled_token_outside_top_k_is_included_with_its_rank(tiny_checkpoints):
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", max_model_len=256, block_size=16,
              enforce_eager=True)
    params = SamplingParams(temperature=5.0, seed=3, max_tokens=20, logprobs=0, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": random_prompts([10])[0]}, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert out.prompt_logprobs is None
    ranks = [e[t].rank for t, e in zip(completion.token_ids, completion.logprobs)]
    assert all(len(e) == 1 for e in completion.logprobs)  # logprobs=0: the chosen token only
    assert max(ranks) > 1  # a hot temperature picks unlikely tokens
    tok = llm.get_tokenizer()
    t0 = completion.token_ids[0]
    assert completion.logprobs[0][t0].decoded_token == tok.decode([t0])


def test_too_many_logprobs_is_a_clear_error(tiny_checkpoints):
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", max_model_len=256, block_size=16,
              enforce_eager=True, max_logprobs=5)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field}=6 exceeds max_logprobs=5"):
            llm.generate("hi", SamplingParams(**{field: 6}), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate("hi", SamplingParams(max_tokens=2, logprobs=5), use_tqdm=False)[0].finished


def test_real_model_logprobs_match_transformers():
    model = hf_model(smollm2_path())
    prompt = "Chunked prefill splits a long prompt into pieces, so that the decodes of other requests"
    llm = LLM(dtype="float32", max_num_batched_tokens=8, max_num_seqs=8, block_size=16,
              max_model_len=256, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=K_SAMPLE, prompt_logprobs=K_PROMPT)
    outs = llm.generate([prompt], params, use_tqdm=False)
    _check_against(model, outs)
