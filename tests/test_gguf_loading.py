"""quantization="gguf" as an engine argument and in the GGUF loader: what it refuses, by name."""

import numpy as np
import pytest

from tests.k_quant_blocks import quantize_q4_k
from vllm import EngineArgs
from vllm.model_executor.layers.quantization.gguf_blocks import GGUFBlocks
from vllm.model_executor.model_loader.gguf_weights import iter_gguf_weights
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.hpu import HpuPlatform

gguf = pytest.importorskip("gguf")


def _gguf_file(path, quant_type) -> str:
    """A GGUF file of one (8, 64) q_proj matrix of `quant_type`, quantized by the gguf package."""
    weights = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(weights, quant_type), raw_dtype=quant_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_supported_blocks_are_yielded_as_blocks(tmp_path):
    path = _gguf_file(tmp_path / "q4_1.gguf", gguf.GGMLQuantizationType.Q4_1)
    [(name, blocks)] = list(iter_gguf_weights(path, num_heads=1, num_kv_heads=1, keep_quantized=True))
    assert name == "model.layers.0.self_attn.q_proj.weight"
    assert isinstance(blocks, GGUFBlocks) and blocks.shape == (8, 64) and blocks.data.shape == (8, 40)
    [(_, dense)] = list(iter_gguf_weights(path, num_heads=1, num_kv_heads=1))
    assert dense.shape == (8, 64)


def test_q4_k_blocks_are_yielded_as_super_blocks(tmp_path):
    """An (8, 512) Q4_K matrix: rows of two super-blocks of 144 bytes."""
    weights = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "q4_k.gguf"), "llama")
    writer.add_tensor("blk.0.attn_q.weight", quantize_q4_k(weights), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    [(_, blocks)] = list(iter_gguf_weights(str(tmp_path / "q4_k.gguf"), num_heads=1, num_kv_heads=1,
                                           keep_quantized=True))
    assert blocks.shape == (8, 512) and blocks.data.shape == (8, 288)
    [(_, dense)] = list(iter_gguf_weights(str(tmp_path / "q4_k.gguf"), num_heads=1, num_kv_heads=1))
    want = gguf.quants.dequantize(blocks.data.numpy(), gguf.GGMLQuantizationType.Q4_K)
    assert np.array_equal(dense.numpy(), want)


def test_rows_not_whole_super_blocks_are_refused_naming_the_file(tmp_path):
    """A Q4_K tensor of (4, 64): one super-block's bytes, rows of a quarter of one. The header
    reader refuses the file; the error says which file and which tensor."""
    path = tmp_path / "partial_q4_k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros(144, dtype=np.int8), raw_shape=(4, 64),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for keep_quantized in (True, False):
        with pytest.raises(ValueError, match=rf"{path}: tensor blk.0.attn_q.weight: rows of 64 are not whole Q4_K"):
            list(iter_gguf_weights(str(path), num_heads=1, num_kv_heads=1, keep_quantized=keep_quantized))


def test_unsupported_type_is_named(tmp_path):
    path = _gguf_file(tmp_path / "q5_0.gguf", gguf.GGMLQuantizationType.Q5_0)
    with pytest.raises(ValueError, match=r"is Q5_0.*supported: Q8_0, Q4_0, Q4_1, Q4_K"):
        list(iter_gguf_weights(path, num_heads=1, num_kv_heads=1, keep_quantized=True))
    assert len(list(iter_gguf_weights(path, num_heads=1, num_kv_heads=1))) == 1  # dequantized: fine


def test_gguf_needs_a_gguf_model(tiny_checkpoints):
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf model"):
        EngineArgs(model=tiny_checkpoints["llama"], quantization="gguf").create_engine_config(CpuPlatform())


def test_gguf_runs_on_one_rank():
    with pytest.raises(ValueError, match="runs on one rank; got tensor_parallel_size=2"):
        EngineArgs(quantization="gguf", tensor_parallel_size=2).create_engine_config(CpuPlatform())


def test_hpu_refuses_quantization_naming_what_it_supports():
    hpu = HpuPlatform.__new__(HpuPlatform)  # its class attributes, without a Gaudi stack
    with pytest.raises(ValueError, match=r"quantization='gguf' is not supported yet on hpu \(supported "
                                         r"there: none, unquantized weights only\)"):
        EngineArgs(quantization="gguf").create_engine_config(hpu)
