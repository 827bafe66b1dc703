"""Structured outputs (xgrammar): every kind of constraint is followed to its end, the mask picks
the model's best allowed token, constrained and free requests share steps without touching each
other, chunking and preemption change nothing, and bad constraints are refused before they run.
JSON on the default model (SmolLM2), whose JSON ends; the rest on the tiny Llama."""

import json
import re

import httpx2
import openai
import pytest
import torch

from tests.server_utils import ServerThread
from tests.utils import hf_model, random_prompts
from vllm import LLM, AsyncLLMEngine, SamplingParams
from vllm.entrypoints.openai.api_server import build_app
from vllm.sampling_params import StructuredOutputsParams

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
COLOURS = ["red", "green", "blue"]  # one token each in SmolLM2's vocabulary


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, **{"max_tokens": 60, **kwargs})


@pytest.fixture(scope="module")
def smollm2():
    return LLM(max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8, kv_cache_memory_bytes=64 * 2**20)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], dtype="float32", max_model_len=256, block_size=16,
               max_num_batched_tokens=512, enforce_eager=True, kv_cache_memory_bytes=64 * 2**20)


def test_json_on_the_default_model(smollm2):
    messages = [{"role": "user", "content": "Give me a person as JSON with a name and an age."}]
    kinds = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(json=json.dumps(SCHEMA)),
             StructuredOutputsParams(json_object=True)]
    outs = [smollm2.chat(messages, _greedy(structured_outputs=kind), use_tqdm=False)[0].outputs[0] for kind in kinds]
    for out in outs:
        assert out.finish_reason == "stop"
        value = json.loads(out.text)
        assert isinstance(value, dict)
    person = json.loads(outs[0].text)
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    free = smollm2.chat(messages, _greedy(), use_tqdm=False)[0].outputs[0].text
    with pytest.raises(json.JSONDecodeError):  # unconstrained, the model wraps its JSON in prose
        json.loads(free)


@pytest.mark.parametrize("constraint, check", [
    (dict(choice=["yes", "no", "maybe so"]), lambda text: text in ("yes", "no", "maybe so")),
    (dict(regex=r"[0-9]{3}-[a-z]{2}"), lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)),
    (dict(grammar='root ::= ("cat" | "dog") " " [0-9] [0-9]?'),
     lambda text: re.fullmatch(r"(cat|dog) [0-9][0-9]?", text)),
])
def test_choices_regexes_and_grammars_are_followed_to_their_end(tiny, constraint, check):
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 60], seed=2)]
    so = StructuredOutputsParams(**constraint)
    greedy = tiny.generate(prompts, _greedy(structured_outputs=so), use_tqdm=False)
    sampled = tiny.generate(prompts, SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=60, structured_outputs=so),
                            use_tqdm=False)
    for out in [o for r in greedy + sampled for o in r.outputs]:
        assert out.finish_reason == "stop" and check(out.text), out.text
    # With ignore_eos the completed grammar still ends the request.
    ignoring = tiny.generate(prompts[0], _greedy(structured_outputs=so, ignore_eos=True), use_tqdm=False)[0]
    assert ignoring.outputs[0].finish_reason == "stop" and check(ignoring.outputs[0].text)
    assert len(tiny.llm_engine.structured_output) == 0  # finished requests leave no matcher behind


def test_json_without_any_whitespace_is_compact_and_ends(tiny):
    """The random model writes whitespace wherever JSON allows it, up to max_tokens; with
    disable_any_whitespace its JSON is compact and complete."""
    schema = {"type": "object", "properties": {"colour": {"enum": COLOURS}, "n": {"type": "boolean"}},
              "required": ["colour", "n"], "additionalProperties": False}
    prompt = {"prompt_token_ids": random_prompts([20], seed=5)[0]}
    loose = tiny.generate(prompt, _greedy(structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)
    assert loose[0].outputs[0].finish_reason == "length"  # still in whitespace
    compact = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    out = tiny.generate(prompt, _greedy(structured_outputs=compact), use_tqdm=False)[0].outputs[0]
    value = json.loads(out.text)
    assert out.finish_reason == "stop" and value["colour"] in COLOURS and isinstance(value["n"], bool)
    assert "\n" not in out.text and "  " not in out.text
    # Any object: its keys are free (this model's never end), its first one starts at once.
    any_object = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    out = tiny.generate(prompt, _greedy(structured_outputs=any_object, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert out.text.startswith(('{"', "{}")), out.text
    with pytest.raises(ValueError, match="disable_any_whitespace must be True or False"):
        StructuredOutputsParams(json=schema, disable_any_whitespace="yes")


def test_the_mask_keeps_the_models_best_allowed_token(tiny, tiny_checkpoints):
    """The first token of a choice is transformers' argmax over the tokens that start one of the
    choices (a grammar takes any tokenization of its strings: "gre" + "en" too)."""
    tokenizer = tiny.get_tokenizer()
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    starts = [i for i, text in enumerate(texts) if text and any(c.startswith(text) for c in COLOURS)]
    assert len(starts) > len(COLOURS)
    model = hf_model(tiny_checkpoints["llama"])
    prompts = random_prompts([3, 17, 40, 90], seed=8)
    outs = tiny.generate([{"prompt_token_ids": p} for p in prompts],
                         _greedy(structured_outputs=StructuredOutputsParams(choice=COLOURS)), use_tqdm=False)
    firsts = []
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt])).logits[0, -1]
        first = out.outputs[0].token_ids[0]
        assert first == max(starts, key=lambda i: logits[i].item()) and out.outputs[0].text in COLOURS
        firsts.append(first)
    assert len(set(firsts)) > 1  # not one token whatever the prompt


def test_constrained_and_free_requests_share_steps_and_survive_chunking_and_preemption(tiny_checkpoints, tiny):
    """At a 16-token budget in a 12-block cache (chunks, preemptions), each request gets what it
    gets alone in a roomy engine; the free ones are untouched by their neighbours' masks."""
    stressed = LLM(tiny_checkpoints["llama"], dtype="float32", max_model_len=160, block_size=16,
                   max_num_batched_tokens=16, num_gpu_blocks_override=12, enforce_eager=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([30, 70, 12, 50, 90], seed=4)]
    regex = StructuredOutputsParams(regex=r"([a-z]{1,4} ){3}[0-9]{2}")
    params = [_greedy(structured_outputs=regex), _greedy(max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=60, structured_outputs=regex),
              _greedy(max_tokens=40, ignore_eos=True), _greedy(structured_outputs=regex)]
    together = stressed.generate(prompts, params, use_tqdm=False)
    assert stressed.llm_engine.scheduler.num_preemptions > 0
    for prompt, p, got in zip(prompts, params, together, strict=True):
        alone = tiny.generate(prompt, p, use_tqdm=False)[0]
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in alone.outputs]
        if p.structured_outputs is not None:
            assert all(o.finish_reason == "stop" and re.fullmatch(r"([a-z]{1,4} ){3}[0-9]{2}", o.text)
                       for o in got.outputs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(structured_outputs=StructuredOutputsParams(json={"type": "nonsense"})), "structured_outputs: .*nonsense"),
    (dict(structured_outputs=StructuredOutputsParams(regex="(ab")), "structured_outputs: .*[Rr]egex"),
    (dict(structured_outputs=StructuredOutputsParams(grammar="start ::= \"a\"")), "structured_outputs: .*root"),
    (dict(structured_outputs=StructuredOutputsParams(json_object=True), min_tokens=2), "min_tokens cannot"),
])
def test_bad_constraints_are_refused_before_anything_runs(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny.generate("hi", SamplingParams(max_tokens=5, **kwargs), use_tqdm=False)
    assert not tiny.llm_engine.has_unfinished_requests()
    assert len(tiny.llm_engine.structured_output) == 0


@pytest.mark.parametrize("fields", [{}, dict(json=SCHEMA, regex="a"), dict(choice=[]), dict(json=3),
                                    dict(json_object=False)])
def test_structured_outputs_params_take_exactly_one_constraint(fields):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**fields)


# ---------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def server(smollm2):
    with ServerThread(build_app(AsyncLLMEngine(smollm2.llm_engine), ["smollm2"], log_stats=False)) as server:
        yield server


def test_the_servers_response_format_and_vllms_fields(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Give me a person as JSON with a name and an age."}]
    schema = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    person = json.loads(schema.choices[0].message.content)
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    anything = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=60, temperature=0,
                                              response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    for extra, check in [({"guided_choice": COLOURS}, lambda text: text in COLOURS),
                         ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda text: re.fullmatch("[0-9]{3}", text))]:
        completion = client.completions.create(model="smollm2", prompt="My favourite colour is", max_tokens=10,
                                               temperature=0, extra_body=extra)
        assert check(completion.choices[0].text) and completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, words", [
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, ["guided_regex", "response_format"]),
    ({"guided_json": {"type": "nonsense"}}, ["structured_outputs", "nonsense"]),
    ({"structured_outputs": {"regexp": "a"}}, ["structured_outputs", "regexp"]),
    ({"response_format": {"type": "json_schema"}}, ["json_schema.schema"]),
])
def test_bad_structured_outputs_are_a_400(server, extra, words):
    resp = httpx2.post(f"{server.url}/v1/completions", json={"model": "smollm2", "prompt": "hi", **extra})
    assert resp.status_code == 400, resp.text
    for word in words:
        assert word in resp.json()["error"]["message"]
