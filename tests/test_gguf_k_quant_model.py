"""quantization="gguf" on k-quant GGUF files: a tiny random Llama (hidden size 256, so every
matrix is whole super-blocks) with SmolLM2's tokenizer, written with every matrix Q4_K, or as
llama.cpp writes Q4_K_M (Q6_K for the output matrix and, in some layers, attn_v and ffn_down),
against the same file's weights dequantized when loaded (the unquantized path)."""

import functools
import logging
import os

import numpy as np
import pytest
import torch

from tests.k_quant_blocks import Q4_K, Q6_K, quantize_q4_k, quantize_q6_k
from tests.utils import build_tiny_checkpoint, random_prompts, smollm2_path
from vllm import LLM, EngineArgs, SamplingParams
from vllm.model_executor.layers.quantization import cpu_gguf_gemv
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.hpu import HpuPlatform

gguf = pytest.importorskip("gguf")

# Hugging Face name (after "model.layers.N.") -> GGUF name (after "blk.N.").
_LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
                "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
                "self_attn.o_proj.weight": "attn_output.weight",
                "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
                "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[rest]}"


_QUANTIZE = {Q4_K: quantize_q4_k, Q6_K: quantize_q6_k}
# As llama.cpp's Q4_K_M: the output matrix and some layers' attn_v and ffn_down in Q6_K.
_Q4_K_M_Q6_K = ("output.weight", "blk.0.attn_v.weight", "blk.0.ffn_down.weight")


@functools.cache
def _smollm2_tokenizer_fields() -> list[tuple]:
    """(key, value, type, array element type) of each tokenizer field of SmolLM2's GGUF, read
    once for the files this module writes (the gguf package parses a header in seconds)."""
    fields = []
    for key, field in gguf.GGUFReader(smollm2_path()).fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), field.types[0], sub_type))
    return fields


def _write_k_quant_gguf(checkpoint: str, path: str, q6_k: tuple[str, ...] = ()) -> str:
    """The Llama checkpoint's matrices as Q4_K, those named in `q6_k` as Q6_K (norms float32), in
    a GGUF file at `path`, with its
    config as llama.* fields and the tokenizer fields of SmolLM2's GGUF (the checkpoint's
    tokenizer). The weights are random, so q/k rows are written in their Hugging Face order."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    writer = gguf.GGUFWriter(path, "llama")
    for key, value, value_type, sub_type in _smollm2_tokenizer_fields():
        writer.add_key_value(key, value, value_type, sub_type)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    for name, weight in load_file(os.path.join(checkpoint, "model.safetensors")).items():
        weight = weight.float().numpy()
        if weight.ndim == 2:
            quant_type = Q6_K if _gguf_name(name) in q6_k else Q4_K
            writer.add_tensor(_gguf_name(name), _QUANTIZE[quant_type](weight),
                              raw_dtype=gguf.GGMLQuantizationType(quant_type))
        else:
            writer.add_tensor(_gguf_name(name), weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_checkpoint(tokenizer_dir, tmp_path_factory) -> str:
    return build_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("k_quant") / "hf"), tokenizer_dir,
                                 hidden_size=256)


@pytest.fixture(scope="module")
def q4_k_gguf(tiny_checkpoint, tmp_path_factory) -> str:
    return _write_k_quant_gguf(tiny_checkpoint, str(tmp_path_factory.mktemp("q4_k") / "tiny.Q4_K.gguf"))


@pytest.fixture(scope="module")
def q4_k_m_gguf(tiny_checkpoint, tmp_path_factory) -> str:
    return _write_k_quant_gguf(tiny_checkpoint, str(tmp_path_factory.mktemp("q4_k_m") / "tiny.Q4_K_M.gguf"),
                               _Q4_K_M_Q6_K)


@functools.cache
def _run(path: str, quantization: str) -> tuple[list[list[int]], LLM]:
    """Greedy tokens of prompts of 3-90 tokens in 32-token steps: decodes (1-4 rows) and chunks."""
    llm = LLM(path, quantization=quantization, dtype="float32", max_num_batched_tokens=32, max_num_seqs=4,
              block_size=16, max_model_len=256, kv_cache_memory_bytes=16 << 20, enable_chunked_prefill=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 40, 17, 90], seed=11)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


@pytest.mark.skipif(not cpu_gguf_gemv.available(), reason="the GGUF kernels need a C compiler")
def test_q4_k_weights_stay_in_their_blocks(q4_k_gguf):
    model = _run(q4_k_gguf, "gguf")[1].llm_engine.runner.model
    matrices = {name: p for name, p in model.named_parameters() if p.dim() == 2}
    assert matrices and all(getattr(p, "quant_type", None) == Q4_K for p in matrices.values())
    down = matrices["model.layers.0.mlp.down_proj.weight"]
    assert down.dtype == torch.uint8 and down.shape == (256, 512 // 256 * 144)


@pytest.mark.skipif(not cpu_gguf_gemv.available(), reason="the GGUF kernels need a C compiler")
def test_q4_k_float32_greedy_identical_to_dequantized_weights(q4_k_gguf):
    """dtype=float32 multiplies the Q4_K blocks' exact float32 values (as the gguf package
    dequantizes them); only the order of the float32 sums differs from the unquantized path."""
    ours, ref = _run(q4_k_gguf, "gguf")[0], _run(q4_k_gguf, "none")[0]
    assert ours == ref
    assert len({tuple(t) for t in ours}) > 1 and len({*np.concatenate(ours).tolist()}) > 8  # not one token on repeat


@pytest.mark.skipif(not cpu_gguf_gemv.available(), reason="the GGUF kernels need a C compiler")
def test_a_q4_k_m_file_keeps_each_matrix_in_its_own_type(q4_k_m_gguf):
    """llama.cpp's usual mix of types runs quantized: the Q6_K matrices (the lm_head among them)
    stay in their blocks beside the Q4_K ones, and float32 greedy tokens are those of the same
    weights dequantized when loaded."""
    assert _resolved(q4_k_m_gguf, CpuPlatform()) == "gguf"
    ours, llm = _run(q4_k_m_gguf, "gguf")
    model = llm.llm_engine.runner.model
    types = {name: getattr(p, "quant_type", None) for name, p in model.named_parameters() if p.dim() == 2}
    assert types.pop("lm_head.weight") == Q6_K
    assert types.pop("model.layers.0.mlp.down_proj.weight") == Q6_K
    # q, k and v are one stacked matrix: with Q6_K v beside Q4_K q and k, it is dequantized, to
    # the values the unquantized path loads.
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert types.pop(qkv) is None
    assert set(types.values()) == {Q4_K}
    ref, dense = _run(q4_k_m_gguf, "none")
    assert torch.equal(model.get_parameter(qkv), dense.llm_engine.runner.model.get_parameter(qkv))
    assert ours == ref


@pytest.mark.skipif(not cpu_gguf_gemv.available(), reason="the GGUF kernels need a C compiler")
def test_auto_dtype_is_bf16_only_where_the_int8_gemm_takes_every_type(q4_k_gguf, q4_k_m_gguf):
    """Without native bf16 dot products, dtype="auto" is bf16 for a GGUF file only where the int8
    GEMM decodes all its types (a token's result then does not depend on its step): Q4_K with
    AVX512-VNNI's GEMM, never Q6_K (so never a Q4_K_M file)."""
    from vllm.platforms.cpu import cpu_has_native_bf16_dot

    def dtype(path: str) -> torch.dtype:
        config, _, _ = EngineArgs(model=path, kv_cache_memory_bytes=16 << 20).create_engine_config(CpuPlatform())
        return config.model.dtype

    native = cpu_has_native_bf16_dot()
    assert dtype(q4_k_gguf) == (torch.bfloat16 if native or cpu_gguf_gemv.gemm_takes(Q4_K) else torch.float32)
    assert dtype(q4_k_m_gguf) == (torch.bfloat16 if native else torch.float32)


class _CpuWithoutQ4K(CpuPlatform):
    """The CPU platform of a build whose kernels take every supported type but Q4_K."""

    def gguf_kernel_types(self):
        return super().gguf_kernel_types() - {"Q4_K"}


def _resolved(path: str, platform, **kwargs) -> str | None:
    config, _, _ = EngineArgs(model=path, kv_cache_memory_bytes=16 << 20, **kwargs).create_engine_config(platform)
    return config.model.quantization


@pytest.mark.skipif(not cpu_gguf_gemv.available(), reason="the GGUF kernels need a C compiler")
def test_a_gguf_file_runs_on_its_blocks_by_default_where_the_kernels_take_its_types(q4_k_gguf, caplog,
                                                                                   monkeypatch):
    """As in vLLM, a .gguf model runs quantized unless told otherwise; where a kernel is
    missing, or on several ranks, its tensors are dequantized and the log says why."""
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)  # to caplog's handler
    assert _resolved(q4_k_gguf, CpuPlatform()) == "gguf"
    assert _resolved(q4_k_gguf, CpuPlatform(), quantization="none") is None
    with caplog.at_level("INFO", logger="vllm.engine.arg_utils"):
        assert _resolved(q4_k_gguf, _CpuWithoutQ4K()) is None
    assert "dequantized to the compute dtype when loaded (Q4_K has no kernel on cpu)" in caplog.text
    assert _resolved(q4_k_gguf, CpuPlatform(), tensor_parallel_size=2) is None
    hpu = HpuPlatform.__new__(HpuPlatform)  # its class attributes, without a Gaudi stack
    assert _resolved(q4_k_gguf, hpu) is None
