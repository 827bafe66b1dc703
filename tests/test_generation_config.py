"""The model's generation config: its EOS ids end requests, its sampling settings are the
defaults of requests that give none (generation_config="auto" | "vllm" | a directory)."""

import json
import os
import shutil

import pytest

from vllm import LLM, SamplingParams

ENGINE = dict(dtype="float32", max_model_len=128, block_size=16, max_num_batched_tokens=32,
              num_gpu_blocks_override=64)
PROMPTS = ["Hello there", "The capital of France is"]


def with_generation_config(src: str, dst: str, **fields) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "generation_config.json"), "w") as f:
        json.dump(fields, f)
    return dst


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    """Greedy tokens of the plain tiny model, past any EOS."""
    llm = LLM(tiny_checkpoints["llama"], **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_every_eos_id_of_the_generation_config_ends_a_request(tiny_checkpoints, reference, tmp_path):
    eos = reference[0][4]  # a token the first prompt generates; let it be the model's second EOS
    primary = LLM(tiny_checkpoints["llama"], **ENGINE).get_tokenizer().eos_token_id
    path = with_generation_config(tiny_checkpoints["llama"], str(tmp_path / "two_eos"),
                                  eos_token_id=[primary, eos])
    params = SamplingParams(temperature=0, max_tokens=12)
    for mode in ("auto", "vllm"):  # EOS ids apply in both modes
        llm = LLM(path, generation_config=mode, **ENGINE)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        for out, ref in zip(outs, reference, strict=True):
            end = ref.index(eos) + 1 if eos in ref else len(ref)
            completion = out.outputs[0]
            assert completion.token_ids == ref[:end]
            if eos in ref:
                assert completion.finish_reason == "stop" and completion.stop_reason == eos
    assert params.stop_token_ids == []  # the caller's params are left alone
    ignoring = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ignoring] == reference


def test_min_tokens_holds_back_the_other_eos_ids(tiny_checkpoints, reference, tmp_path):
    eos = reference[0][1]
    path = with_generation_config(tiny_checkpoints["llama"], str(tmp_path / "eos"), eos_token_id=[eos])
    out = LLM(path, **ENGINE).generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6,
                                                                  min_tokens=4), use_tqdm=False)[0]
    assert eos not in out.outputs[0].token_ids[:4]


def test_default_sampling_params_follow_the_generation_config(tiny_checkpoints, tmp_path):
    path = with_generation_config(tiny_checkpoints["llama"], str(tmp_path / "defaults"),
                                  temperature=0.0, top_k=7, top_p=0.9, repetition_penalty=1.1,
                                  max_new_tokens=5, do_sample=True)
    llm = LLM(path, **ENGINE)
    assert llm.get_default_sampling_params() == SamplingParams(
        temperature=0.0, top_k=7, top_p=0.9, repetition_penalty=1.1, max_tokens=5)
    outs = llm.generate(PROMPTS, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) <= 5 for o in outs)
    assert any(len(o.outputs[0].token_ids) == 5 for o in outs)
    # An explicit SamplingParams is taken as it is, as in vLLM's LLM.
    explicit = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0]
    assert len(explicit.outputs[0].token_ids) == 8

    assert LLM(path, generation_config="vllm", **ENGINE).get_default_sampling_params() == SamplingParams()
    overridden = LLM(path, override_generation_config={"max_new_tokens": 3, "top_k": None}, **ENGINE)
    assert overridden.get_default_sampling_params() == SamplingParams(
        temperature=0.0, top_p=0.9, repetition_penalty=1.1, max_tokens=3)


def test_generation_config_from_a_directory(tiny_checkpoints, tmp_path):
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"max_new_tokens": 2}))
    llm = LLM(tiny_checkpoints["llama"], generation_config=str(other), **ENGINE)
    assert llm.get_default_sampling_params() == SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="generation_config="):
        LLM(tiny_checkpoints["llama"], generation_config=str(tmp_path / "missing"), **ENGINE)
