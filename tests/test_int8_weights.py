"""quantization="int8": per-channel int8 weights made at load (int8_weights.py), stored as Q8_0
blocks of one scale per row, against the same model with its linear weights replaced by their
dequantized int8 values (fake-quantized: the same weights, dense). A tiny random Llama (head_dim
64, so that bf16 prefill chunks take the C decoder layers too) for exact float32 tokens and the
layout; SmolLM2 for bf16, whose int8 activations only a trained model's margins can judge."""

import pytest
import torch

from tests.utils import assert_greedy_close, build_tiny_checkpoint, random_prompts, tokens_op_by_op_then_fused
from vllm import LLM, EngineArgs, SamplingParams
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.quantization import gguf_linear, int8_weights
from vllm.model_executor.layers.quantization.gguf_blocks import GGUFBlocks
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.model_loader import load_hf_config, resident_weight_bytes, resolve_model_source
from vllm.model_executor.model_loader.hf_weights import iter_hf_weights
from vllm.model_executor.models.registry import resolve_model_class
from vllm.platforms.cpu import CpuPlatform, cpu_flags
from vllm.platforms.hpu import HpuPlatform

PROMPTS = random_prompts([5, 70, 23, 130, 9, 41], seed=3)  # decodes, and prompts of several chunks
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint(tokenizer_dir, tmp_path_factory) -> str:
    return build_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("int8_llama")), tokenizer_dir,
                                 hidden_size=256)


@pytest.fixture(scope="module")
def engines(checkpoint):
    """(quantization, dtype, budget) -> the checkpoint's engine, made once for this file."""
    made: dict[tuple, LLM] = {}

    def get(quantization: str | None, dtype: str, budget: int) -> LLM:
        key = (quantization, dtype, budget)
        if key not in made:
            made[key] = LLM(checkpoint, quantization=quantization, dtype=dtype, max_model_len=512, block_size=16,
                            num_gpu_blocks_override=256, enable_chunked_prefill=True,
                            max_num_batched_tokens=budget)
        return made[key]

    yield get
    made.clear()


def _products(llm: LLM) -> dict[str, Linear]:
    """The model's product layers (every Linear but the lm_head), by name."""
    return {name: m for name, m in llm.llm_engine.runner.model.named_modules()
            if isinstance(m, Linear) and not isinstance(m, ParallelLMHead)}


def _fake_quantized(engines, budget: int) -> LLM:
    """The unquantized float32 engine with each product weight replaced by the int8 engine's
    dequantized blocks."""
    llm = engines(None, "float32", budget)
    quantized = _products(engines("int8", "float32", budget))
    with torch.no_grad():
        for name, layer in _products(llm).items():
            layer.weight.copy_(gguf_linear.dequantize(quantized[name].weight, torch.float32))
    return llm


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _rows_of(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, in / 32 * 34) Q8_0 -> scales (rows, in / 32) float32, codes (rows, in) int8."""
    data = blocks.view(blocks.shape[0], -1, 34)
    scales = data[..., :2].contiguous().view(torch.float16).squeeze(2).float()
    return scales, data[..., 2:].contiguous().view(torch.int8).view(blocks.shape[0], -1)


def test_rows_are_per_channel_int8_of_the_checkpoint(checkpoint, engines):
    """Every block of a row carries the row's scale; codes within [-127, 127], the row's largest
    weight at +-127 (so the scale is max|W_r| / 127, up to fp16's rounding), every weight within
    scale / 2 of scale * code; q/k/v and gate/up are their shards' rows, stacked."""
    from safetensors.torch import load_file

    tensors = load_file(f"{checkpoint}/model.safetensors")
    layers = _products(engines("int8", "float32", 64))
    assert len(layers) == 8
    parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    for name, layer in layers.items():
        leaf = name.rsplit(".", 1)[1]
        dense = torch.cat([tensors[f"{name.rsplit('.', 1)[0]}.{p}.weight"] for p in parts.get(leaf, [leaf])])
        assert layer.weight.quant_type == int8_weights.Q8_0 and layer.weight.dtype == torch.uint8
        scales, codes = _rows_of(layer.weight.data)
        assert torch.all(scales == scales[:, :1])
        assert codes.abs().max() <= 127 and torch.all(codes.abs().amax(dim=1) == 127)
        error = (dense - scales.repeat_interleave(32, dim=1) * codes.float()).abs()
        assert torch.all(error <= scales[:, :1] / 2 * (1 + 1e-6)), name  # 1e-6: float32's W / d


def test_quantize_rows_edge_cases():
    """An all-zero row (codes 0), a row whose scale is a tiny fp16 subnormal (rounded up, by a
    third here: no code clipped, the error still within scale / 2), bf16 input; the errors
    naming a tensor whose largest weight has no fp16 scale or whose input features are not whole
    blocks."""
    weight = torch.zeros(3, 64)
    weight[1] = torch.linspace(-1e-6, 1e-5, 64)  # d: 1.3 steps of fp16's smallest subnormal
    weight[2] = torch.linspace(-2.0, 1.0, 64)
    for dense in (weight, weight.bfloat16()):
        blocks = int8_weights.quantize_rows(dense, "w")
        assert isinstance(blocks, GGUFBlocks) and blocks.data.shape == (3, 68)
        scales, codes = _rows_of(blocks.data)
        # A normal fp16 scale rounds up by at most 2^-10: the largest weight's code stays 127.
        assert torch.all(codes[0] == 0) and codes[2].abs().max() == 127 and codes.abs().max() <= 127
        error = (dense.float() - scales.repeat_interleave(32, dim=1) * codes.float()).abs()
        assert torch.all(error <= scales[:, :1] / 2 * (1 + 1e-6))
    for bad in (torch.full((2, 32), torch.inf), torch.full((2, 32), 1e7)):  # 1e7 / 127: past fp16's range
        with pytest.raises(ValueError, match=r"cannot quantize w: a row's largest weight is not finite"):
            int8_weights.quantize_rows(bad, "w")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight: its 48 input features are "
                                         r"not a multiple of 32"):
        int8_weights.quantize_rows(torch.ones(4, 48), "model.layers.0.mlp.down_proj.weight")


def test_product_weights_reach_the_model_as_blocks(checkpoint):
    """The loader hands the model blocks for every product weight, never the dense tensor (so no
    dense copy of it is ever written), and the vocabulary tables, norms as they are."""
    config = load_hf_config(resolve_model_source(checkpoint))
    with torch.device("meta"):
        model = resolve_model_class(config)(config, max_position=16, dtype=torch.float32)
    kinds = {name: isinstance(t, GGUFBlocks)
             for name, t in int8_weights.quantize_linear_weights(iter_hf_weights(checkpoint), model)}
    blocks = {name for name, is_blocks in kinds.items() if is_blocks}
    assert blocks == {f"model.layers.{i}.{p}.weight" for i in range(2)
                      for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(kinds) - blocks


def test_resident_bytes_are_the_blocks(engines):
    """The product weights take 34 bytes per 32 weights (under 0.3 of float32); the rest of the
    model (embedding, lm_head, norms) stays in float32."""
    int8, dense = engines("int8", "float32", 64), engines(None, "float32", 64)
    weights = [layer.weight for layer in _products(dense).values()]
    dense_bytes = sum(w.numel() * 4 for w in weights)
    block_bytes = sum(w.numel() * 34 // 32 for w in weights)
    assert block_bytes < 0.3 * dense_bytes
    assert sum(layer.weight.numel() for layer in _products(int8).values()) == block_bytes
    assert (resident_weight_bytes(int8.llm_engine.runner.model)
            == resident_weight_bytes(dense.llm_engine.runner.model) - dense_bytes + block_bytes)


@pytest.mark.parametrize("budget", [16, 64])
def test_float32_greedy_identical_to_fake_quantized(engines, budget):
    """float32 multiplies the blocks' exact values (d * q) with float32 sums: the tokens of the
    dense model on those values, at two chunk sizes (prompts of 1-9 chunks, decodes beside them)."""
    ours = _generate(engines("int8", "float32", budget))
    assert ours == _generate(_fake_quantized(engines, budget))


def test_bfloat16_close_to_fake_quantized_on_smollm2():
    """SmolLM2's GGUF (dequantized when read, then quantized to int8), where real margins make
    the comparison mean something: bf16 activations, quantized per 32-block to int8 in decodes
    where the CPU has int8 dot products, may flip near-ties (the bound of tests/test_gguf_model.py):
    where the tokens first differ from the float32 fake-quantized run, each run's token is in
    the other's top 5, and the runs agree until then on most tokens."""
    from tests.test_real_model import PROMPTS as REAL_PROMPTS

    prompts, max_tokens = [REAL_PROMPTS[1], REAL_PROMPTS[5], REAL_PROMPTS[6]], 32
    kwargs = dict(max_num_batched_tokens=64, max_num_seqs=8, block_size=16, max_model_len=512,
                  kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5)

    def run(llm: LLM) -> tuple[list[list[int]], list]:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].logprobs for o in outs]

    int8 = LLM(dtype="bfloat16", quantization="int8", **kwargs)
    ours, our_logprobs = run(int8)
    fake = LLM(dtype="float32", quantization="none", **kwargs)  # dense float32 on the int8 values
    quantized = _products(int8)
    with torch.no_grad():
        for name, layer in _products(fake).items():
            layer.weight.copy_(gguf_linear.dequantize(quantized[name].weight, torch.float32))
    ref, ref_logprobs = run(fake)
    assert_greedy_close(ours, ref, our_logprobs, ref_logprobs, min_agreed=len(prompts) * max_tokens // 2)


@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="the C layers' attention kernels need AVX512-BF16")
def test_bfloat16_runs_the_fused_layers_on_the_blocks(engines):
    """bf16 steps (decodes and 64-token chunks) run each decoder layer as one C call on the Q8_0
    blocks, to the op-by-op path's tokens."""
    llm = engines("int8", "bfloat16", 64)
    assert llm.llm_engine.runner.attn_backend.fused_layers is not None
    outputs = tokens_op_by_op_then_fused(llm, lambda: _generate(llm))
    assert outputs[0] == outputs[1]


def test_int8_runs_on_one_rank(checkpoint):
    args = EngineArgs(model=checkpoint, quantization="int8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization='int8' runs on one rank; got tensor_parallel_size=2"):
        args.create_engine_config(CpuPlatform())


def test_hpu_refuses_int8_naming_what_it_supports(checkpoint):
    hpu = HpuPlatform.__new__(HpuPlatform)  # its class attributes, without a Gaudi stack
    with pytest.raises(ValueError, match=r"quantization='int8' is not supported yet on hpu \(supported "
                                         r"there: none, unquantized weights only\)"):
        EngineArgs(model=checkpoint, quantization="int8").create_engine_config(hpu)


def test_input_features_not_whole_blocks_are_refused(tokenizer_dir, tmp_path):
    """hidden_size 48: the rows of q/k/v and gate/up are not whole blocks of 32; the error names
    the first such tensor the checkpoint holds."""
    path = build_tiny_checkpoint("llama", str(tmp_path), tokenizer_dir, hidden_size=48)
    with pytest.raises(ValueError, match=r"cannot quantize model\.layers\.0\.\w+\.\w+_proj\.weight: its 48 "
                                         r"input features are not a multiple of 32"):
        LLM(path, quantization="int8", dtype="float32", max_model_len=64, num_gpu_blocks_override=8)
