"""A GGUF file's metadata converted once (vllm/model_executor/model_loader/gguf_metadata.py): the
config, tokenizer and tensors read from the kept files are those read from the file itself, a
later engine start parses no GGUF header, a changed file is converted again (the kept files of
changed or deleted files are removed), and without a writable cache everything is read from the
file as before."""

import functools
import os

import numpy as np
import pytest
import torch

from tests.utils import smollm2_path, smollm2_tokenizer
from vllm.model_executor.model_loader import gguf_metadata, load_hf_config, load_tokenizer, resolve_model_source
from vllm.model_executor.model_loader.gguf_weights import iter_gguf_weights, quantized_type_names

gguf = pytest.importorskip("gguf")

TEXTS = ["Hello, my name is", "  two spaces\n\nnewlines <|im_start|>user", "émoji 🙂 中文", "def f(x):\n\treturn x**2"]


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    gguf_metadata._read_index_of_version.cache_clear()
    yield tmp_path / "cache"
    gguf_metadata._read_index_of_version.cache_clear()


def _kept_dirs(cache_root) -> list[str]:
    root = cache_root / "gguf-metadata"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


@functools.cache
def _direct():
    """SmolLM2's config and tokenizer as transformers reads them from the GGUF file."""
    from transformers import AutoConfig

    path = smollm2_path()
    return (AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True),
            smollm2_tokenizer())


def _assert_same_model_metadata(config, tokenizer) -> None:
    ref_config, ref_tokenizer = _direct()
    ours, ref = config.to_dict(), ref_config.to_dict()
    ours.pop("_name_or_path"), ref.pop("_name_or_path")
    assert ours == ref
    assert tokenizer.get_vocab() == ref_tokenizer.get_vocab()
    assert tokenizer.all_special_ids == ref_tokenizer.all_special_ids
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (ref_tokenizer.bos_token_id, ref_tokenizer.eos_token_id)
    for text in TEXTS:
        assert tokenizer(text).input_ids == ref_tokenizer(text).input_ids, text
    messages = [{"role": "user", "content": "hi"}]
    assert (tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == ref_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def _reference_weights(path: str, names: set[str]) -> tuple[int, dict[str, np.ndarray]]:
    """The file's tensor count, and some tensors' raw bytes, as the gguf package's reader maps them."""
    reader = gguf.GGUFReader(path)
    return len(reader.tensors), {t.name: np.asarray(t.data).view(np.uint8).reshape(-1)
                                 for t in reader.tensors if t.name in names}


def test_kept_metadata_is_what_the_file_holds_and_a_later_start_parses_no_header(cache_root, monkeypatch):
    source = resolve_model_source(smollm2_path())
    config, tokenizer = load_hf_config(source), load_tokenizer(source)
    [kept] = _kept_dirs(cache_root)
    assert {"config.json", "tokenizer.json", "tensors.json"} <= set(os.listdir(cache_root / "gguf-metadata" / kept))
    _assert_same_model_metadata(config, tokenizer)

    # A later start: neither a reader of the header nor transformers' GGUF conversion runs.
    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF header was parsed again")

    gguf_metadata._read_index_of_version.cache_clear()
    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    monkeypatch.setattr(gguf_metadata, "read_gguf_index", refuse)
    from transformers import modeling_gguf_pytorch_utils

    monkeypatch.setattr(modeling_gguf_pytorch_utils, "load_gguf_checkpoint", refuse)
    again = load_hf_config(source)
    assert again.to_dict() | {"_name_or_path": ""} == config.to_dict() | {"_name_or_path": ""}
    assert load_tokenizer(source).get_vocab() == tokenizer.get_vocab()
    assert quantized_type_names(smollm2_path()) == {"Q4_1", "Q8_0"}
    blocks = dict(iter_gguf_weights(smollm2_path(), config.num_attention_heads, config.num_key_value_heads,
                                    keep_quantized=True))
    dense = dict(iter_gguf_weights(smollm2_path(), config.num_attention_heads, config.num_key_value_heads))
    monkeypatch.undo()

    # The tensors' bytes are those the reader maps (v_proj and the norms are not permuted).
    names = {"blk.3.attn_v.weight": "model.layers.3.self_attn.v_proj.weight",
             "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
             "token_embd.weight": "model.embed_tokens.weight"}
    count, reference = _reference_weights(smollm2_path(), set(names))
    assert len(blocks) == len(dense) == count
    v, norm = blocks[names["blk.3.attn_v.weight"]], blocks[names["blk.0.attn_norm.weight"]]
    assert np.array_equal(v.data.numpy().reshape(-1), reference["blk.3.attn_v.weight"])
    assert np.array_equal(norm.numpy().view(np.uint8), reference["blk.0.attn_norm.weight"])
    embedding = reference["token_embd.weight"].reshape(dense[names["token_embd.weight"]].shape[0], -1)
    expected = gguf.dequantize(embedding, gguf.GGMLQuantizationType(blocks[names["token_embd.weight"]].quant_type))
    assert torch.equal(dense[names["token_embd.weight"]], torch.from_numpy(expected.astype(np.float32)))


def _write_one_matrix(path: str) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    weights = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()


def test_a_changed_file_is_converted_again_and_its_old_version_removed(cache_root, tmp_path):
    path = str(tmp_path / "one_matrix.gguf")
    _write_one_matrix(path)
    assert quantized_type_names(path) == {"Q8_0"}
    [first] = _kept_dirs(cache_root)
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    assert quantized_type_names(path) == {"Q8_0"}
    [second] = _kept_dirs(cache_root)
    assert second != first


def test_a_conversion_removes_the_metadata_of_changed_or_deleted_files_only(cache_root, tmp_path):
    paths = {name: str(tmp_path / f"{name}.gguf") for name in ("gone", "changed", "alive", "other")}
    for name in ("gone", "changed", "alive"):
        _write_one_matrix(paths[name])
        quantized_type_names(paths[name])
    by_name = {name.split("-")[0]: name for name in _kept_dirs(cache_root)}
    os.remove(paths["gone"])
    _write_one_matrix(paths["changed"])  # a new version, not yet converted
    os.utime(paths["changed"], ns=(0, os.stat(paths["changed"]).st_mtime_ns + 10**9))
    root = cache_root / "gguf-metadata"
    # As if made by other transformers or gguf versions (another environment sharing the cache):
    # its key is not this one's, but its file is unchanged.
    (root / by_name["alive"]).rename(root / "alive-0000000000000000")
    (root / "made-by-hand").mkdir()
    _write_one_matrix(paths["other"])
    quantized_type_names(paths["other"])
    kept = _kept_dirs(cache_root)
    assert len(kept) == 3 and [name for name in kept if not name.startswith("other-")] == [
        "alive-0000000000000000", "made-by-hand"]


def test_without_a_writable_cache_the_file_is_read_each_time(tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(blocker))
    gguf_metadata._read_index_of_version.cache_clear()
    source = resolve_model_source(smollm2_path())
    _assert_same_model_metadata(load_hf_config(source), load_tokenizer(source))
    assert quantized_type_names(smollm2_path()) == {"Q4_1", "Q8_0"}
    assert blocker.is_file()
