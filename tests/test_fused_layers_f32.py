"""The C decoder layers on float32 rows (llama_cpu_layers.c's llama_layers_f32) against the op-by-op
float32 layers: steps of decodes, on any CPU with AVX2 and FMA (the float32 GEMV's ISA)."""

import random

import pytest
import torch

from tests.test_fused_layers import BLOCK, _assert_fused_matches_op_by_op, _step
from tests.utils import random_prompts, smollm2_path, tokens_op_by_op_then_fused
from vllm import LLM, SamplingParams
from vllm.model_executor.layers import cpu_gemv


pytestmark = pytest.mark.skipif(cpu_gemv.max_rows(torch.float32) == 0,
                                reason="the float32 GEMV, and so the float32 C layers, need AVX2 with FMA")


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def f32_llm(request, tiny_checkpoints) -> LLM:
    return LLM(tiny_checkpoints[request.param], dtype="float32", max_model_len=512, block_size=BLOCK,
               num_gpu_blocks_override=512, enforce_eager=True)


def test_float32_models_take_the_c_layers_for_steps_of_decodes(f32_llm):
    fused = f32_llm.llm_engine.runner.attn_backend.fused_layers
    assert fused is not None and not fused.takes_prefills
    assert fused.max_tokens == cpu_gemv.max_rows(torch.float32)


@pytest.mark.parametrize("contexts", [[0], [37], [5, 200, 16], [130, 1, 64, 300],
                                      [11 * i % 170 for i in range(16)], [7 * i % 150 for i in range(48)]])
def test_float32_decode_steps_match_op_by_op(f32_llm, contexts):
    """The same hidden states and cache writes within float32's rounding (a norm's sum and SiLU's
    exp in another order), for 1-48 decodes at contexts that cross blocks and (Mistral) the
    sliding window of 96; past keys are random."""
    _assert_fused_matches_op_by_op(f32_llm.llm_engine.runner, contexts, [], random.Random(len(contexts)))


def test_float32_steps_with_prefills_or_past_the_gemv_rows_stay_op_by_op(f32_llm):
    runner = f32_llm.llm_engine.runner
    fused = runner.attn_backend.fused_layers
    metadata, positions = _step(runner, [5], [(9, 0)], random.Random(0))
    assert not fused.accepts(metadata, positions.shape[0])
    rows = fused.max_tokens + 1
    metadata, positions = _step(runner, [3] * rows, [], random.Random(1))
    assert not fused.accepts(metadata, positions.shape[0])
    assert not runner.attn_backend.runs_eagerly(rows, rows)


def test_engine_decodes_float32_through_fused_layers(f32_llm):
    """Whole generations of 2 and 9 prompts: their decode steps take the C layers, and the tokens
    are those of the op-by-op path."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 40, 17, 90, 8, 61, 5, 70, 30], seed=5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = tokens_op_by_op_then_fused(
        f32_llm, lambda: [o.outputs[0].token_ids for o in f32_llm.generate(prompts[:2], params, use_tqdm=False)
                          + f32_llm.generate(prompts, params, use_tqdm=False)])
    assert outputs[0] == outputs[1]


def test_a_float32_model_of_gguf_blocks_keeps_its_layers_op_by_op():
    """GGUF products take bf16 rows: a float32 model whose weights stay in blocks has no C layers."""
    llm = LLM(smollm2_path(), dtype="float32", quantization="gguf", max_model_len=256, num_gpu_blocks_override=64)
    assert llm.llm_engine.runner.attn_backend.fused_layers is None
    outputs = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=3))
    assert len(outputs[0].outputs[0].token_ids) == 3
