"""Stop strings: spanning tokens, on the first token, kept or cut, and min_tokens."""

import pytest

from tests.utils import random_prompts
from vllm import LLM, SamplingParams

PROMPT = {"prompt_token_ids": random_prompts([20], seed=5)[0]}


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], dtype="float32", max_model_len=256, block_size=16,
               max_num_batched_tokens=16, enforce_eager=True)


@pytest.fixture(scope="module")
def free_run(llm):
    """The greedy continuation without stops, and each token's text."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    pieces = [tok.decode(out.token_ids[:i + 1]) for i in range(len(out.token_ids))]
    return out, pieces


def _gen(llm, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kwargs)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


def test_stop_spanning_two_tokens(llm, free_run):
    full, pieces = free_run
    # The last character of token 3's text and the first of token 4's: complete only once
    # token 4 arrives.
    start = len(pieces[2]) - 1
    assert start > len(pieces[1]) and len(pieces[3]) > len(pieces[2])
    stop = full.text[start:start + 2]
    assert full.text.find(stop) == start, "pick a prompt whose stop occurs once"
    out = _gen(llm, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:start] and len(out.token_ids) == 4
    kept = _gen(llm, stop=stop, include_stop_str_in_output=True)
    assert kept.text == full.text[:start + len(stop)] and kept.token_ids == out.token_ids


def test_stop_at_the_very_first_token(llm, free_run):
    full, pieces = free_run
    out = _gen(llm, stop=[pieces[0]])
    assert out.token_ids == full.token_ids[:1] and out.text == "" and out.finish_reason == "stop"
    kept = _gen(llm, stop=[pieces[0]], include_stop_str_in_output=True)
    assert kept.text == pieces[0]


def test_earliest_of_several_stops_wins_and_min_tokens_defers_it(llm, free_run):
    full, pieces = free_run
    late, early = full.text[len(pieces[6]):len(pieces[7])], pieces[1][len(pieces[0]):]
    out = _gen(llm, stop=[late, early])
    assert out.stop_reason == early and len(out.token_ids) == 2
    # Before min_tokens outputs exist, stop strings do not count.
    deferred = _gen(llm, stop=[early], min_tokens=4)
    assert len(deferred.token_ids) > 2 and deferred.text.startswith(full.text[:len(pieces[1])])


def test_no_match_runs_to_max_tokens(llm, free_run):
    full, _ = free_run
    out = _gen(llm, stop=["\x00never\x00"])
    assert out.text == full.text and out.finish_reason == "length" and out.stop_reason is None


def test_stop_completed_by_the_last_allowed_token_wins_over_the_length(llm, free_run):
    full, pieces = free_run
    # A token whose own text first occurs where it is, so the stop completes with that token.
    i = next(i for i in range(2, len(pieces))
             if len(pieces[i]) > len(pieces[i - 1])
             and full.text.find(pieces[i][len(pieces[i - 1]):]) == len(pieces[i - 1]))
    stop = pieces[i][len(pieces[i - 1]):]
    params = SamplingParams(temperature=0, max_tokens=i + 1, ignore_eos=True, stop=[stop])
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == pieces[i - 1] and out.token_ids == full.token_ids[:i + 1]
