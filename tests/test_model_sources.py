"""Hub ids resolve from the local Hugging Face cache (never the network), at a revision."""

import hashlib
import os
import socket

import pytest

from vllm import LLM, EngineArgs, SamplingParams
from vllm.platforms.cpu import CpuPlatform

REPO_ID = "tiny-org/tiny-llama"
MAIN, V2 = "a" * 40, "b" * 40


def add_snapshot(cache: str, repo_id: str, commit: str, checkpoint: str, refs: list[str]) -> None:
    """Lays `checkpoint`'s files out as huggingface_hub's cache does: content-addressed blobs,
    snapshots/<commit>/ linking to them, refs/<name> holding the commit."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(snapshot)
    for name in os.listdir(checkpoint):
        with open(os.path.join(checkpoint, name), "rb") as f:
            data = f.read()
        blob = os.path.join(repo, "blobs", hashlib.sha256(data).hexdigest())
        with open(blob, "wb") as f:
            f.write(data)
        os.symlink(os.path.relpath(blob, snapshot), os.path.join(snapshot, name))
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for ref in refs:
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_checkpoints) -> str:
    cache = str(tmp_path_factory.mktemp("hub"))
    add_snapshot(cache, REPO_ID, MAIN, tiny_checkpoints["llama"], ["main"])
    add_snapshot(cache, REPO_ID, V2, tiny_checkpoints["qwen2"], ["v2"])
    return cache


@pytest.fixture
def offline(monkeypatch):
    """Any attempt to open a network connection fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the engine tried to use the network")
    monkeypatch.setattr(socket.socket, "connect", refuse)


def model_type(**kwargs) -> str:
    config, _, _ = EngineArgs(**kwargs).create_engine_config(CpuPlatform())
    return config.model.hf_config.model_type


def test_hub_id_generates_as_its_local_directory(hub_cache, tiny_checkpoints, monkeypatch, offline):
    monkeypatch.setenv("HF_HUB_CACHE", hub_cache)
    kwargs = dict(dtype="float32", max_model_len=128, block_size=16, max_num_batched_tokens=32,
                  num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    hub = LLM(REPO_ID, **kwargs)
    assert hub.llm_engine.config.model.model == REPO_ID
    local = LLM(tiny_checkpoints["llama"], **kwargs)
    prompts = ["Hello there", "The capital of France"]
    assert ([o.outputs[0].token_ids for o in hub.generate(prompts, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in local.generate(prompts, params, use_tqdm=False)])


def test_revision_picks_the_snapshot(hub_cache, monkeypatch, offline):
    monkeypatch.setenv("HF_HUB_CACHE", hub_cache)
    assert model_type(model=REPO_ID) == "llama"
    assert model_type(model=REPO_ID, revision="main") == "llama"
    assert model_type(model=REPO_ID, revision="v2") == "qwen2"
    assert model_type(model=REPO_ID, revision=V2) == "qwen2"  # a commit hash
    with pytest.raises(ValueError, match="at revision 'v3'.*hf download"):
        model_type(model=REPO_ID, revision="v3")


def test_download_dir_names_the_cache(hub_cache, tmp_path, monkeypatch, offline):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache
    with pytest.raises(ValueError, match="nor in the Hugging Face cache at "):
        model_type(model=REPO_ID)
    assert model_type(model=REPO_ID, download_dir=hub_cache) == "llama"


def test_tokenizer_hub_id_and_revision(hub_cache, tiny_checkpoints, monkeypatch, offline):
    monkeypatch.setenv("HF_HUB_CACHE", hub_cache)
    config, _, tokenizer_source = EngineArgs(
        model=tiny_checkpoints["llama"], tokenizer=REPO_ID,
        tokenizer_revision="v2").create_engine_config(CpuPlatform())
    assert config.model.tokenizer == REPO_ID
    assert tokenizer_source.directory.endswith(V2)


def test_unknown_hub_id_says_nothing_is_downloaded(hub_cache, monkeypatch, offline):
    monkeypatch.setenv("HF_HUB_CACHE", hub_cache)
    with pytest.raises(ValueError, match="never downloads"):
        LLM("someone/not-cached")
