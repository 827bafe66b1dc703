"""/tokenize and /detokenize on the tiny Llama: the ids are the ones the engine reads for the same
completion or chat request (its usage counts them), detokenize inverts tokenize, and bad requests
get a 400 or 404 that names the problem."""

import httpx2
import pytest

from tests.server_utils import ServerThread
from vllm import AsyncLLMEngine, EngineArgs
from vllm.entrypoints.openai.api_server import build_app

ENGINE_KWARGS = dict(dtype="float32", max_model_len=256, block_size=16, max_num_batched_tokens=64,
                     max_num_seqs=8, enforce_eager=True, kv_cache_memory_bytes=32 * 2**20)
MODEL = "tiny-llama"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    return AsyncLLMEngine.from_engine_args(EngineArgs(model=tiny_checkpoints["llama"], **ENGINE_KWARGS))


@pytest.fixture(scope="module")
def post(engine):
    with ServerThread(build_app(engine, [MODEL], log_stats=False)) as server:
        def post(path: str, body: dict | str) -> httpx2.Response:
            if isinstance(body, str):  # JSON as sent, e.g. with escapes Python cannot encode
                return httpx2.post(f"{server.url}{path}", content=body, headers={"Content-Type": "application/json"})
            return httpx2.post(f"{server.url}{path}", json=body)
        yield post


def test_tokenize_gives_the_prompt_ids_of_a_completion(post, engine):
    tokenizer = engine.tokenizer
    prompt = "The capital of France is"
    resp = post("/tokenize", {"model": MODEL, "prompt": prompt}).json()
    assert resp["tokens"] == tokenizer(prompt).input_ids and resp["count"] == len(resp["tokens"])
    assert resp["max_model_len"] == 256 and resp["token_strs"] is None
    usage = post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == resp["count"]
    bare = post("/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()["tokens"]
    assert bare == tokenizer(prompt, add_special_tokens=False).input_ids
    strs = post("/tokenize", {"prompt": prompt, "return_token_strs": True}).json()["token_strs"]
    assert strs == tokenizer.convert_ids_to_tokens(resp["tokens"])
    # A prompt longer than the model takes is counted, not refused: the client compares the two.
    long = post("/tokenize", {"prompt": "hi " * 300}).json()
    assert long["count"] > long["max_model_len"]


def test_tokenize_of_messages_is_the_chat_prompt(post, engine):
    tokenizer = engine.tokenizer
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    resp = post("/tokenize", {"model": MODEL, "messages": MESSAGES}).json()
    assert resp["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    usage = post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == resp["count"]
    without = post("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert without["count"] < resp["count"]


def test_continue_final_message_ends_the_prompt_inside_it(post, engine):
    partial = MESSAGES + [{"role": "assistant", "content": "My favourite is"}]
    body = {"messages": partial, "add_generation_prompt": False, "continue_final_message": True}
    tokens = post("/tokenize", body).json()["tokens"]
    assert engine.tokenizer.decode(tokens).endswith("My favourite is")
    closed = post("/tokenize", {"messages": partial, "add_generation_prompt": False}).json()["tokens"]
    assert len(closed) > len(tokens) and closed[:len(tokens)] == tokens
    reply = post("/v1/chat/completions", {"model": MODEL, "messages": partial, "max_tokens": 2,
                                          "add_generation_prompt": False, "continue_final_message": True})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(tokens)


@pytest.fixture
def bos_tokenizer(engine):
    """The served tokenizer made to add a BOS token, as many models' do (SmolLM2's adds none)."""
    tokenizer = engine.tokenizer
    tokenizer.add_bos_token = True
    tokenizer.update_post_processor()
    yield tokenizer
    tokenizer.add_bos_token = False
    tokenizer.update_post_processor()


def test_add_special_tokens_defaults_to_what_the_engine_adds(post, bos_tokenizer):
    bos = bos_tokenizer.bos_token_id
    prompt = "hi there"
    tokens = post("/tokenize", {"prompt": prompt}).json()["tokens"]
    assert tokens == [bos] + bos_tokenizer(prompt, add_special_tokens=False).input_ids
    usage = post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == len(tokens)
    assert post("/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()["tokens"] == tokens[1:]
    # The chat template writes its own special tokens: by default none are added to them.
    chat = post("/tokenize", {"messages": MESSAGES}).json()["tokens"]
    assert chat[0] != bos or chat[1] != bos
    usage = post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == len(chat)
    assert post("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}).json()["tokens"] == [bos] + chat


def test_detokenize_inverts_tokenize(post):
    prompt = "Paged attention, in chunks."
    tokens = post("/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()["tokens"]
    assert post("/detokenize", {"model": MODEL, "tokens": tokens}).json() == {"prompt": prompt}
    assert post("/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, status, words", [
    ("/tokenize", {"model": "gpt-4", "prompt": "hi"}, 404, ["gpt-4", "does not exist"]),
    ("/tokenize", {}, 400, ["either prompt or messages"]),
    ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, 400, ["either prompt or messages"]),
    ("/tokenize", {"prompt": 5}, 400, ["prompt"]),
    ("/tokenize", r'{"prompt": "\ud800"}', 400, ["Unicode"]),
    ("/tokenize", {"messages": []}, 400, ["messages"]),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400,
     ["add_generation_prompt", "continue_final_message"]),
    ("/v1/chat/completions", {"messages": MESSAGES, "continue_final_message": True}, 400,
     ["add_generation_prompt", "continue_final_message"]),
    ("/detokenize", {"tokens": [1, 10**9, -1]}, 400, ["vocabulary", "1000000000", "-1"]),
    ("/detokenize", {"tokens": "1 2"}, 400, ["tokens"]),
    ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, ["gpt-4"]),
])
def test_bad_requests(post, path, body, status, words):
    resp = post(path, body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == status
    for word in words:
        assert word in error["message"], error["message"]
