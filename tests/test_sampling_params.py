"""SamplingParams: vLLM's defaults, normalisation, and a ValueError naming the field."""

import dataclasses

import pytest

from vllm import SamplingParams

_INVALID = [  # (field, bad value): wrong range, wrong type, bool where a number is expected
    ("n", 0), ("n", -1), ("n", 1.0), ("n", True), ("n", "2"),
    ("best_of", 0), ("best_of", 2), ("best_of", 1.5), ("best_of", True),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", "0"),
    ("presence_penalty", True), ("presence_penalty", float("nan")),
    ("frequency_penalty", 3.0), ("frequency_penalty", -3), ("frequency_penalty", None),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", False),
    ("repetition_penalty", float("inf")),
    ("temperature", -0.1), ("temperature", "hot"), ("temperature", float("inf")),
    ("temperature", False),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", True), ("top_p", None),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True), ("top_k", "5"),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", "0.1"), ("min_p", True),
    ("seed", 1.0), ("seed", "7"), ("seed", True),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", 3]), ("stop", 5), ("stop", {"a"}),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]),
    ("stop_token_ids", 5), ("stop_token_ids", "12"),
    ("include_stop_str_in_output", 1), ("ignore_eos", "yes"),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 2.0), ("max_tokens", True),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 1.0), ("min_tokens", True),
    ("logprobs", -1), ("logprobs", 1.0), ("logprobs", True),
    ("prompt_logprobs", -1), ("prompt_logprobs", "5"), ("prompt_logprobs", False),
    ("skip_special_tokens", None), ("spaces_between_special_tokens", 0),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {"x": 1.0}), ("logit_bias", {"-3": 1.0}),
    ("logit_bias", {1.0: 1.0}), ("logit_bias", {1: "2"}), ("logit_bias", {1: float("nan")}),
    ("logit_bias", {True: 1.0}), ("logit_bias", [(1, 2.0)]),
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", [1.0]),
    ("allowed_token_ids", 5), ("allowed_token_ids", [True]),
    ("bad_words", "word"), ("bad_words", [""]), ("bad_words", [" "]), ("bad_words", [3]),
    ("structured_outputs", {"json_object": True}), ("structured_outputs", "json"),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2), ("truncate_prompt_tokens", 2.0),
    ("truncate_prompt_tokens", True),
]


@pytest.mark.parametrize("name,value", _INVALID, ids=[f"{n}={v!r}" for n, v in _INVALID])
def test_invalid_values_raise_value_error_naming_the_field(name, value):
    with pytest.raises(ValueError, match=rf"^{name}\b"):  # the message starts with the field
        SamplingParams(**{name: value})


def test_every_field_has_an_invalid_case():
    names = {f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_")}
    assert names == {name for name, _ in _INVALID}


def test_messages_state_the_allowed_range():
    message = r"presence_penalty must be a number in \[-2, 2\], got 3.0"
    with pytest.raises(ValueError, match=message):
        SamplingParams(presence_penalty=3.0)
    with pytest.raises(ValueError, match="best_of > n is not supported"):
        SamplingParams(n=2, best_of=3)
    with pytest.raises(ValueError, match=r"min_tokens must be an integer in \[0, max_tokens=4\]"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.prompt_logprobs) == (16, 0, None,
                                                                                    None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.greedy


def test_valid_edges_are_accepted_and_normalised():
    p = SamplingParams(n=3, best_of=3, presence_penalty=-2, frequency_penalty=2, temperature=0,
                       top_p=1, top_k=-1, min_p=1, seed=-3, max_tokens=None, min_tokens=100,
                       stop_token_ids=(5, 0), logprobs=0, prompt_logprobs=20)
    assert p.top_k == 0 and p.greedy and p.stop_token_ids == [5, 0]
    assert isinstance(p.temperature, float) and isinstance(p.presence_penalty, float)
    assert SamplingParams(n=4).best_of == 4
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


@pytest.mark.parametrize("stop,expected", [(None, []), ("###", ["###"]),
                                           (["a", "bc"], ["a", "bc"]), (("x",), ["x"])])
def test_stop_is_normalised_to_a_list_of_strings(stop, expected):
    assert SamplingParams(stop=stop).stop == expected


def test_clone_is_independent():
    p = SamplingParams(stop=["a"], stop_token_ids=[1], seed=3)
    q = p.clone()
    q.stop.append("b")
    q.stop_token_ids.append(2)
    assert p.stop == ["a"] and p.stop_token_ids == [1] and q.seed == 3


def test_logit_bias_keys_become_ids_and_biases_are_clipped_as_in_vllm():
    p = SamplingParams(logit_bias={"12": 150, 7: -0.5, "0": -101.5})
    assert p.logit_bias == {12: 100.0, 7: -0.5, 0: -100.0}
    assert SamplingParams(allowed_token_ids=(4, 2)).allowed_token_ids == [4, 2]


def test_bad_words_are_tokenized_at_the_start_and_after_a_space(tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    p = SamplingParams(bad_words=["hello", " world peace"])
    assert p.bad_words_token_ids == []  # until the engine tokenizes them
    p.update_from_tokenizer(tokenizer)
    ids = [tokenizer.encode(text, add_special_tokens=False)
           for text in ("hello", " hello", "world peace", " world peace")]
    assert p.bad_words_token_ids == ids and ids[0][0] != ids[1][0]
    assert dataclasses.replace(p, n=1).bad_words_token_ids == p.bad_words_token_ids  # forks keep them
