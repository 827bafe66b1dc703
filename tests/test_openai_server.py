"""The OpenAI-compatible server through the real `openai` client, on the tiny Llama: greedy texts
equal `LLM.generate`'s, streaming adds up to the whole, bad requests get the right status, and a
client that leaves aborts its request and frees its KV blocks."""

import time

import httpx2
import openai
import pytest

from tests.server_utils import ServerThread
from tests.utils import random_prompts
from vllm import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from vllm.entrypoints.openai.api_server import add_cors, build_app

ENGINE_KWARGS = dict(dtype="float32", max_model_len=256, block_size=16, max_num_batched_tokens=64,
                     max_num_seqs=8, enforce_eager=True, kv_cache_memory_bytes=32 * 2**20)
PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3,"]
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    return AsyncLLMEngine.from_engine_args(EngineArgs(model=tiny_checkpoints["llama"], **ENGINE_KWARGS))


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(build_app(engine, [MODEL])) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], **ENGINE_KWARGS)


def wait_until_idle(engine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.num_unfinished_requests or engine.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.01)
    bm = engine.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_completions_greedy_equal_llm_generate(client, llm):
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for prompt, ref in zip(PROMPTS, expected):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        choice = resp.choices[0]
        assert choice.text == ref.outputs[0].text and choice.finish_reason == ref.outputs[0].finish_reason
        assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert resp.model == MODEL and resp.id.startswith("cmpl-")


def test_streamed_completion_adds_up_with_usage_last(client, llm):
    ref = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 5  # streamed, not one piece
    assert "".join(texts) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_several_prompts_in_one_request_and_echo(client, llm):
    expected = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6, temperature=0, echo=True)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [p + r.outputs[0].text for p, r in zip(PROMPTS, expected)]


def test_chat_equals_llm_chat_streamed_or_not(client, llm):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content == ref.text
    assert resp.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_n_seed_logprobs_and_stop(client, llm):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, n=3, seed=7,
                                     temperature=1.0, logprobs=2)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    again = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, n=3, seed=7,
                                      temperature=1.0, logprobs=2)
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]  # seeded
    for choice in resp.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
        assert all(len(top) <= 3 and all(v <= 0 for v in top.values()) for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    # A stop string split over two tokens: the stream must not send its first part early.
    ref = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    full, tok = ref.text, llm.get_tokenizer()
    ends = [len(tok.decode(ref.token_ids[:j], skip_special_tokens=True)) for j in range(1, 20)]
    end = next(e for a, e, b in zip(ends, ends[1:], ends[2:]) if e - a >= 2 and b - e >= 2 and e >= 4)
    stop = full[end - 2:end + 2]
    assert full.index(stop) == end - 2
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=[stop], stream=True))
    assert streamed == full[:full.index(stop)]


def test_logit_bias_allowed_ids_and_bad_words_reach_the_sampler(client, llm):
    """OpenAI's logit_bias (string keys) and vLLM's allowed_token_ids and bad_words, in completions
    and chat, give what LLM.generate gives for the same SamplingParams."""
    fields = [dict(logit_bias={"1000": 100}), dict(allowed_token_ids=[2000, 2001, 2002]),
              dict(bad_words=["the", "in"], logit_bias={"264": 5.0})]
    for extra in fields:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **extra)
        ref = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
        body = dict(extra, ignore_eos=True)
        resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                         extra_body=body)
        assert resp.choices[0].text == ref.text, extra
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=8, temperature=0, extra_body=body)
        assert chat.usage.completion_tokens == 8
        if "logit_bias" in extra and len(extra) == 1:
            assert ref.token_ids == [1000] * 8 and chat.choices[0].message.content == ref.text
        if "allowed_token_ids" in extra:
            assert set(ref.token_ids) <= {2000, 2001, 2002}


def test_models_health_version(server):
    models = httpx2.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 256
    assert httpx2.get(f"{server.url}/health").status_code == 200
    assert httpx2.get(f"{server.url}/version").json()["version"]


@pytest.mark.parametrize("body, status, words", [
    ('{"model": "tiny-llama", "prompt": "hi"', 400, ["JSON"]),  # malformed
    ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, ["max_tokens"]),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, ["max_tokens", ">= 1"]),
    ({"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, ["temperature"]),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, ["top_p"]),
    ({"model": MODEL, "prompt": "hi", "n": 1000}, 400, ["n=1000", "max_num_seqs"]),
    ({"model": MODEL, "prompt": "hi", "suffix": "x"}, 400, ["suffix"]),
    ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, ["stream_options"]),
    ({"model": MODEL}, 400, ["prompt"]),
    ({"model": MODEL, "prompt": [10**9]}, 400, ["vocabulary"]),
    ({"model": "gpt-4", "prompt": "hi"}, 404, ["gpt-4", "does not exist"]),
    ({"model": MODEL, "prompt": "hi " * 300}, 400, ["256", "301"]),  # prompt over max_model_len
    ({"model": MODEL, "prompt": "hi", "max_tokens": 300}, 400, ["256", "300"]),
    ({"model": MODEL, "prompt": "hi", "logprobs": 50}, 400, ["logprobs=50", "max_logprobs"]),  # the engine's check
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"cat": 1}}, 400, ["logit_bias", "token ids"]),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"49152": 1}}, 400, ["logit_bias", "vocabulary", "49152"]),
    ({"model": MODEL, "prompt": "hi", "allowed_token_ids": []}, 400, ["allowed_token_ids", "non-empty"]),
    ({"model": MODEL, "prompt": "hi", "bad_words": [""]}, 400, ["bad_words"]),
])
def test_bad_completion_requests(server, engine, body, status, words):
    kwargs = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, str) \
        else {"json": body}
    resp = httpx2.post(f"{server.url}/v1/completions", **kwargs)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == status
    for word in words:
        assert word in error["message"], error["message"]
    wait_until_idle(engine)


def test_bad_chat_requests(server):
    post = lambda body: httpx2.post(f"{server.url}/v1/chat/completions", json=body)  # noqa: E731
    assert post({"model": MODEL, "messages": []}).status_code == 400
    assert "messages" in post({"model": MODEL, "messages": "hi"}).json()["error"]["message"]
    assert "top_logprobs" in post({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                   "top_logprobs": 2}).json()["error"]["message"]
    assert "tools" in post({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                            "tools": [{"type": "function"}]}).json()["error"]["message"]
    too_long = post({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 300}]})
    assert too_long.status_code == 400 and "256" in too_long.json()["error"]["message"]
    # Cut to its last 64 tokens, it fits (as a completion too).
    for path, body in [("chat/completions", {"messages": [{"role": "user", "content": "hi " * 300}]}),
                       ("completions", {"prompt": "hi " * 300})]:
        cut = httpx2.post(f"{server.url}/v1/{path}", json={"model": MODEL, "max_tokens": 2, **body,
                                                            "truncate_prompt_tokens": 64})
        assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 64, cut.text
    bad = post({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and "truncate_prompt_tokens" in bad.json()["error"]["message"]


def test_prompt_logprobs_are_llm_generates(server, llm):
    """vLLM's prompt_logprobs field: per prompt position (the first has none) the top k and the
    prompt's own token, by token id, as LLM.generate gives them."""
    ref = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    completion = httpx2.post(f"{server.url}/v1/completions", json={
        "model": MODEL, "prompt": PROMPTS[1], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}).json()
    [choice] = completion["choices"]
    ids = ref.prompt_token_ids
    assert len(choice["prompt_logprobs"]) == len(ids) and choice["prompt_logprobs"][0] is None
    for token, got, want in zip(ids[1:], choice["prompt_logprobs"][1:], ref.prompt_logprobs[1:]):
        assert str(token) in got and len(got) <= 3 and {int(t) for t in got} <= set(want)
        for t, entry in got.items():
            assert entry["logprob"] == pytest.approx(want[int(t)].logprob, abs=1e-5)
            assert entry["rank"] == want[int(t)].rank and entry["decoded_token"] == want[int(t)].decoded_token
    chat = httpx2.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])  # only the prompt's token
    # echo with logprobs=3 asks the engine for 3 per prompt position; the field still holds 1.
    echoed = httpx2.post(f"{server.url}/v1/completions", json={
        "model": MODEL, "prompt": PROMPTS[1], "max_tokens": 1, "echo": True, "logprobs": 3, "prompt_logprobs": 1})
    [choice] = echoed.json()["choices"]
    assert max(len(entry) for entry in choice["prompt_logprobs"][1:]) == 2
    assert max(len(top) for top in choice["logprobs"]["top_logprobs"][1:]) >= 3
    streamed = httpx2.post(f"{server.url}/v1/completions", json={
        "model": MODEL, "prompt": "x", "stream": True, "prompt_logprobs": 1})
    assert streamed.status_code == 400 and "prompt_logprobs" in streamed.json()["error"]["message"]


def test_a_bad_request_does_not_disturb_others(client, server, llm):
    ref = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0, stream=True)
    first = next(stream).choices[0].text
    assert httpx2.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 0}).status_code == 400
    assert first + "".join(c.choices[0].text for c in stream) == ref.outputs[0].text


def test_api_key(engine):
    with ServerThread(build_app(engine, [MODEL], api_key="secret", log_stats=False)) as server:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert httpx2.post(f"{server.url}/v1/completions", json=body).status_code == 401
        wrong = httpx2.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer no"})
        assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="secret", max_retries=0)
        assert len(client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices) == 1
        assert httpx2.get(f"{server.url}/health").status_code == 200  # no key needed outside /v1


def test_cors_lets_the_allowed_origins_call_past_the_api_key(engine):
    """A browser's preflight (OPTIONS, no key) is answered before the key is checked; the
    allowed origin then gets the header on its calls, another origin does not."""
    app = build_app(engine, [MODEL], api_key="secret", log_stats=False)
    add_cors(app, ["https://ui.example"], ["GET", "POST"], ["Authorization", "Content-Type"])
    with ServerThread(app) as server:
        url = f"{server.url}/v1/completions"
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        ok = httpx2.options(url, headers={"Origin": "https://ui.example", **preflight})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ui.example"
        assert httpx2.options(url, headers={"Origin": "https://evil.example", **preflight}).status_code == 400
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        key = {"Authorization": "Bearer secret"}
        call = httpx2.post(url, json=body, headers={"Origin": "https://ui.example", **key})
        assert call.status_code == 200 and call.headers["access-control-allow-origin"] == "https://ui.example"
        other = httpx2.post(url, json=body, headers={"Origin": "https://evil.example", **key})
        assert "access-control-allow-origin" not in other.headers


def test_disconnect_aborts_and_frees_blocks(server, engine):
    body = {"model": MODEL, "prompt": random_prompts([50])[0], "max_tokens": 200, "ignore_eos": True}
    stats = engine.engine.stats
    # Streaming: leave after three events.
    decoded = stats.num_decode_tokens
    with httpx2.Client() as http:
        with http.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as resp:
            events = 0
            for line in resp.iter_lines():
                events += line.startswith("data:")
                if events == 3:
                    break
    wait_until_idle(engine, timeout_s=5.0)
    assert stats.num_decode_tokens - decoded < 199  # stopped early: aborted
    # Not streaming: the client gives up (times out) while the request runs.
    decoded = stats.num_decode_tokens
    with pytest.raises(httpx2.TimeoutException):
        httpx2.post(f"{server.url}/v1/completions", json=body, timeout=0.2)
    wait_until_idle(engine, timeout_s=5.0)
    assert stats.num_decode_tokens - decoded < 199


def test_default_model_greedy_equals_llm_generate():
    """SmolLM2 (the default model): the server's greedy texts, whole and streamed, and its chat
    reply equal what LLM.generate and LLM.chat return on the same engine."""
    llm = LLM(max_model_len=512, max_num_batched_tokens=64, block_size=16, kv_cache_memory_bytes=64 * 2**20)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    messages = [{"role": "user", "content": "Name a colour."}]
    expected_chat = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    with ServerThread(build_app(AsyncLLMEngine(llm.llm_engine), ["smollm2"])) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        for prompt, text in zip(prompts, expected):
            assert client.completions.create(model="smollm2", prompt=prompt, max_tokens=16,
                                             temperature=0).choices[0].text == text
            stream = client.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0,
                                               stream=True)
            assert "".join(c.choices[0].text for c in stream) == text
        reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0)
        assert reply.choices[0].message.content == expected_chat
    assert len(set(expected)) == 2 and all(expected)
