"""`LLM.beam_search` on the tiny Llama (float32): the beams transformers' beam search finds, and
those of a plain-loop reference of vLLM's rule when EOS ends some of them; bad parameters refused."""

import json
import time

import httpx2
import pytest
import torch

from tests.server_utils import ServerThread
from tests.utils import hf_model, random_prompts
from vllm import LLM, AsyncLLMEngine, EngineArgs
from vllm.beam_search import BeamSearchSequence, beam_search_score
from vllm.entrypoints.chat_utils import apply_chat_template
from vllm.entrypoints.openai.api_server import build_app
from vllm.sampling_params import BeamSearchParams

PROMPT_LENGTHS = [7, 40]  # the second is chunked at the 32-token budget
ENGINE_KWARGS = dict(dtype="float32", max_model_len=256, block_size=16, max_num_batched_tokens=32,
                     enforce_eager=True, kv_cache_memory_bytes=32 * 2**20)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], **ENGINE_KWARGS)


def _search(llm: LLM, prompts: list[list[int]], **params):
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(**params))
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    return outs


@pytest.mark.parametrize("width", [1, 2, 4])
def test_beams_match_transformers_beam_search(llm, tiny_checkpoints, width):
    model = hf_model(tiny_checkpoints["llama"])
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    outs = _search(llm, prompts, beam_width=width, max_tokens=10, ignore_eos=True)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                                 do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0,
                                 output_scores=True, return_dict_in_generate=True)
        assert [s.tokens[len(prompt):] for s in out.sequences] == [s[len(prompt):].tolist() for s in ref.sequences]
        assert all(s.finish_reason == "length" and len(s.logprobs) == 10 for s in out.sequences)
        if width > 1:  # transformers scores by the generated length: all 10 here
            torch.testing.assert_close(torch.tensor([s.cum_logprob / 10 for s in out.sequences]),
                                       ref.sequences_scores.float(), rtol=0, atol=1e-4)


def _reference(model, prompt: list[int], width: int, max_tokens: int, eos: int,
               length_penalty: float) -> list[tuple[list[int], float]]:
    """vLLM's rule by plain loops: every beam proposes its 2 x width most likely tokens; those that
    are EOS finish, the width most likely others go on; the best `width` by score win."""
    def score(beam):
        tokens, cum = beam
        return cum / ((len(tokens) - (tokens[-1] == eos)) ** length_penalty)

    live, done = [(prompt, 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in live:
            with torch.inference_mode():
                logprobs = model(torch.tensor([tokens])).logits[0, -1].double().log_softmax(-1)
            top = logprobs.topk(2 * width)
            for lp, token in zip(top.values.tolist(), top.indices.tolist()):
                (done if token == eos else candidates).append((tokens + [token], cum + lp))
        live = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(done + live, key=score, reverse=True)[:width]


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 4.0])
def test_eos_finishes_beams_and_the_length_penalty_ranks_them(llm, tiny_checkpoints, monkeypatch, length_penalty):
    """With a likely token made EOS, some beams finish early: they come back with finish_reason
    "stop", their text without the EOS, ranked among the others by the length-penalised score."""
    model = hf_model(tiny_checkpoints["llama"])
    prompt = random_prompts([9], seed=5)[0]
    first = _search(llm, [prompt], beam_width=3, max_tokens=1)[0].sequences
    eos = first[1].tokens[-1]  # the second most likely first token
    monkeypatch.setattr(llm.llm_engine, "eos_token_id", eos)
    out = _search(llm, [prompt], beam_width=3, max_tokens=6, length_penalty=length_penalty)[0].sequences
    expected = _reference(model, prompt, 3, 6, eos, length_penalty)
    assert [s.tokens for s in out] == [tokens for tokens, _ in expected]
    assert [s.cum_logprob for s in out] == pytest.approx([cum for _, cum in expected], abs=1e-4)
    if length_penalty == 4.0:
        # The long beams gain enough to push out a finished one with a better sum of logprobs.
        best_sum = _search(llm, [prompt], beam_width=3, max_tokens=6, length_penalty=0.0)[0].sequences[0]
        assert best_sum.finish_reason == "stop" and best_sum.cum_logprob > out[0].cum_logprob
        assert all(s.finish_reason == "length" for s in out)
        return
    stopped = [s for s in out if s.finish_reason == "stop"]
    assert stopped and all(s.stop_reason == eos and s.tokens[-1] == eos for s in stopped)
    tokenizer = llm.get_tokenizer()
    for s in stopped:
        assert s.text == tokenizer.decode(s.tokens[len(prompt):-1], skip_special_tokens=False)
    kept = _search(llm, [prompt], beam_width=3, max_tokens=6, length_penalty=length_penalty,
                   include_stop_str_in_output=True)[0].sequences
    assert [s.text for s in kept if s.finish_reason == "stop"] == [
        tokenizer.decode(s.tokens[len(prompt):], skip_special_tokens=False) for s in stopped]


def test_bad_beam_search_parameters_are_refused(llm):
    with pytest.raises(ValueError, match="beam_width must be an integer >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        BeamSearchParams(beam_width=2, max_tokens=True)
    with pytest.raises(ValueError, match="needs 22 logprobs a step, over max_logprobs=20"):
        llm.beam_search("hi", BeamSearchParams(beam_width=11, max_tokens=4))
    with pytest.raises(ValueError, match="do not fit max_model_len=256"):
        llm.beam_search({"prompt_token_ids": [5] * 250}, BeamSearchParams(beam_width=2, max_tokens=7))
    assert not llm.llm_engine.has_unfinished_requests()


def test_the_score_divides_by_the_length_without_the_eos():
    def score(tokens: list[int], penalty: float) -> float:
        return beam_search_score(BeamSearchSequence(tokens=tokens, cum_logprob=-3.0), 2, penalty)

    assert score([5, 6, 2], 1.0) == -1.5  # EOS (id 2) at the end does not count
    assert score([5, 6, 7], 1.0) == -1.0 and score([2, 6], 1.0) == -1.5
    assert score([5, 6, 7, 8], 0.5) == -1.5 and score([5, 6, 2], 0.0) == -3.0


# ---------------------------------------------------------------- the server's use_beam_search

@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=tiny_checkpoints["llama"], **ENGINE_KWARGS))
    with ServerThread(build_app(engine, ["tiny"], log_stats=False)) as server:
        server.engine = engine
        yield server


def test_the_server_returns_the_beams_of_llm_beam_search(server, llm):
    prompt = "The capital of France is"
    beams = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))[0].sequences
    body = {"model": "tiny", "prompt": prompt, "n": 3, "max_tokens": 8, "use_beam_search": True,
            "ignore_eos": True, "logprobs": 1}
    resp = httpx2.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert [c["text"] for c in resp["choices"]] == [b.text for b in beams]
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2]
    assert resp["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        [beams[0].logprobs[i][t].logprob for i, t in enumerate(beams[0].tokens[-8:])])
    assert resp["usage"]["completion_tokens"] == 24
    streamed = httpx2.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60).text
    events = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    texts = {}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert [texts[i] for i in range(3)] == [b.text for b in beams]
    messages = [{"role": "user", "content": "Hi"}]
    _, chat_ids = apply_chat_template(llm.get_tokenizer(), messages)
    chat_beams = llm.beam_search({"prompt_token_ids": chat_ids}, BeamSearchParams(beam_width=2, max_tokens=5))
    chat_beams = chat_beams[0].sequences
    chat = httpx2.post(f"{server.url}/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "n": 2, "max_tokens": 5, "use_beam_search": True}, timeout=60).json()
    assert [c["message"]["content"] for c in chat["choices"]] == [b.text for b in chat_beams]


def test_a_beam_search_that_cannot_run_is_a_400_and_a_client_that_leaves_aborts_it(server):
    body = {"model": "tiny", "prompt": "hi", "use_beam_search": True}
    too_wide = httpx2.post(f"{server.url}/v1/completions", json={**body, "n": 11}, timeout=60)
    assert too_wide.status_code == 400 and "max_logprobs=20" in too_wide.json()["error"]["message"]
    bad = httpx2.post(f"{server.url}/v1/completions", json={**body, "length_penalty": "long"}, timeout=60)
    assert bad.status_code == 400 and "length_penalty" in bad.json()["error"]["message"]
    engine = server.engine
    steps_before = engine.engine.stats.num_steps
    with httpx2.stream("POST", f"{server.url}/v1/completions", timeout=60,
                       json={**body, "n": 4, "max_tokens": 200, "ignore_eos": True, "stream": True}):
        deadline = time.monotonic() + 30
        while not engine.num_unfinished_requests:  # the search has begun
            assert time.monotonic() < deadline
            time.sleep(0.01)
    deadline = time.monotonic() + 30
    while engine.num_unfinished_requests or engine.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the search kept running after its client left"
        time.sleep(0.05)
    bm = engine.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    # The whole search would take at least one engine step per token.
    assert engine.engine.stats.num_steps - steps_before < 100
