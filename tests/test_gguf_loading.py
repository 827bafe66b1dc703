"""quantization="gguf" as an engine argument and in the GGUF loader: what it refuses, by name."""

import numpy as np
import pytest

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


def test_unsupported_type_is_named(tmp_path):
    path = _gguf_file(tmp_path / "q5_0.gguf", gguf.GGMLQuantizationType.Q5_0)
    with pytest.raises(ValueError, match=r"is Q5_0.*supported: Q8_0, Q4_0, Q4_1"):
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
