"""Chat templates other than the tokenizer's: `LLM.chat(chat_template=..., chat_template_kwargs=...)`
and the server's `--chat-template`, `--response-role` and `--trust-request-chat-template`, on the
tiny Llama. The prompt is the template's text, whatever path the conversation takes."""

import httpx2
import pytest

from tests.server_utils import ServerThread
from vllm import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from vllm.entrypoints.chat_utils import load_chat_template
from vllm.entrypoints.openai.api_server import build_app

ENGINE_KWARGS = dict(dtype="float32", max_model_len=256, block_size=16, max_num_batched_tokens=32,
                     max_num_seqs=4, enforce_eager=True, kv_cache_memory_bytes=16 * 2**20)
MODEL = "tiny-llama"
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}|{{ greeting | default('none') }}] {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}[reply]{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _rendered(greeting: str = "none", generation_prompt: bool = True) -> str:
    lines = "".join(f"[{m['role']}|{greeting}] {m['content']}\n" for m in MESSAGES)
    return lines + ("[reply]" if generation_prompt else "")


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], **ENGINE_KWARGS)


def _as_plain_prompt(llm: LLM, text: str) -> list[int]:
    """What LLM.generate runs for `text` tokenized as the chat path tokenizes it (no BOS added)."""
    ids = llm.get_tokenizer()(text, add_special_tokens=False).input_ids
    return llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_llm_chat_renders_the_given_template_and_its_variables(llm):
    out = llm.chat(MESSAGES, GREEDY, use_tqdm=False, chat_template=TEMPLATE,
                   chat_template_kwargs={"greeting": "hi"})[0]
    tokenizer = llm.get_tokenizer()
    assert out.prompt_token_ids == tokenizer(_rendered("hi"), add_special_tokens=False).input_ids
    assert out.outputs[0].token_ids == _as_plain_prompt(llm, _rendered("hi"))
    default = llm.chat(MESSAGES, GREEDY, use_tqdm=False)[0]  # the tokenizer's own template
    assert default.prompt_token_ids != out.prompt_token_ids


@pytest.mark.parametrize("kwargs, message", [
    (dict(chat_template_kwargs={"chat_template": "{{ 1 }}"}), "chat_template_kwargs cannot set chat_template"),
    (dict(chat_template_kwargs={"tokenize": True, "x": 1}), "chat_template_kwargs cannot set tokenize"),
    (dict(chat_template="{% for m in messages %}"), "the chat template refused"),  # unclosed tag
    (dict(chat_template="{{ raise_exception('no system role') }}"), "no system role"),
])
def test_llm_chat_refuses_bad_templates_and_variables(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(MESSAGES, GREEDY, use_tqdm=False, **kwargs)
    assert not llm.llm_engine.has_unfinished_requests()


def test_load_chat_template_takes_a_file_or_the_template(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE == load_chat_template(TEMPLATE)
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    return AsyncLLMEngine.from_engine_args(EngineArgs(model=tiny_checkpoints["llama"], **ENGINE_KWARGS))


def _serve(engine, trusting: bool):
    app = build_app(engine, [MODEL], log_stats=False, chat_template=TEMPLATE, response_role="bot",
                    trust_request_chat_template=trusting)
    return ServerThread(app)


@pytest.fixture(scope="module")
def server(engine):
    with _serve(engine, trusting=False) as server:
        yield server


def _chat(server, **fields) -> httpx2.Response:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **fields}
    return httpx2.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_the_server_template_and_response_role(server, llm):
    resp = _chat(server, chat_template_kwargs={"greeting": "yo"}).json()
    message = resp["choices"][0]["message"]
    assert message["role"] == "bot"
    assert message["content"] == llm.get_tokenizer().decode(_as_plain_prompt(llm, _rendered("yo")),
                                                            skip_special_tokens=True)
    tokenized = httpx2.post(f"{server.url}/tokenize", json={
        "model": MODEL, "messages": MESSAGES, "chat_template_kwargs": {"greeting": "yo"}}).json()
    assert resp["usage"]["prompt_tokens"] == tokenized["count"]
    assert tokenized["tokens"] == llm.get_tokenizer()(_rendered("yo"), add_special_tokens=False).input_ids
    # Continuing the last message: the reply keeps that message's role, streamed or not.
    continued = dict(add_generation_prompt=False, continue_final_message=True)
    assert _chat(server, **continued).json()["choices"][0]["message"]["role"] == "user"
    with httpx2.stream("POST", f"{server.url}/v1/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": True}) as stream:
        first = next(line for line in stream.iter_lines() if line.startswith("data: {"))
    assert '"role":"bot"' in first


def test_a_request_template_only_where_the_server_trusts_them(server, engine, llm):
    own = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    refused = _chat(server, chat_template=own)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    with _serve(engine, trusting=True) as trusting:
        resp = _chat(trusting, chat_template=own)
    assert resp.status_code == 200
    assert resp.json()["usage"]["prompt_tokens"] == len(
        llm.get_tokenizer()("Be brief.|Name a colour.|", add_special_tokens=False).input_ids)


@pytest.mark.parametrize("kwargs, words", [
    ({"chat_template": "{{ 1 }}"}, ["chat_template_kwargs cannot set chat_template"]),
    ({"add_generation_prompt": False}, ["cannot set add_generation_prompt"]),
])
def test_template_variables_cannot_replace_the_call_arguments(server, kwargs, words):
    resp = _chat(server, chat_template_kwargs=kwargs)
    assert resp.status_code == 400
    for word in words:
        assert word in resp.json()["error"]["message"]
