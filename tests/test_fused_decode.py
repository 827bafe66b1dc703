"""The C decoder layers for steps of a few decodes (llama_cpu_decode.c) against the op-by-op layers."""

import random

import pytest
import torch

from tests.utils import random_prompts
from vllm import LLM, SamplingParams
from vllm.attention.backends.metadata import SeqSpan, build_attention_metadata
from vllm.forward_context import ForwardContext, forward_context
from vllm.platforms.cpu import cpu_flags

BLOCK = 16

pytestmark = pytest.mark.skipif("avx512_bf16" not in cpu_flags(),
                                reason="the C GEMV, and so the fused layers, need AVX512-BF16")


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def bf16_llm(request, tiny_checkpoints) -> LLM:
    return LLM(tiny_checkpoints[request.param], dtype="bfloat16", max_model_len=512, block_size=BLOCK,
               num_gpu_blocks_override=512, enforce_eager=True)


def _decode_step(runner, contexts: list[int], rng: random.Random):
    """Metadata for one decode per context length, on distinct random blocks."""
    blocks = list(range(1, runner.cache.kv_caches[0][0].shape[0]))
    rng.shuffle(blocks)
    spans, slots = [], []
    for i, ctx in enumerate(contexts):
        table = [blocks.pop() for _ in range(ctx // BLOCK + 1)]
        spans.append(SeqSpan(i, 1, ctx, table))
        slots.append(table[ctx // BLOCK] * BLOCK + ctx % BLOCK)
    return build_attention_metadata(spans, len(spans), slots, BLOCK, runner.heads_per_kv,
                                    runner.sliding_window, runner.cache.pad_block, torch.device("cpu"),
                                    torch.bfloat16, split_prefill=True, paged_decode=True)


@pytest.mark.parametrize("contexts", [[0], [37], [5, 200, 16], [130, 1, 64, 300],
                                      [3, 90, 17, 250, 64, 0, 33],
                                      [11 * i % 170 for i in range(16)], [7 * i % 150 for i in range(32)]])
def test_fused_layers_match_op_by_op(bf16_llm, contexts):
    """Same hidden states and the same cache writes, for 1-32 decodes (the GEMV up to 4 rows, the
    tile GEMM above) at contexts that cross blocks and (Mistral) the sliding window of 96; past
    keys are random."""
    runner = bf16_llm.llm_engine.runner
    model, fused = runner.model.model, runner.fused_decode
    assert fused is not None and fused.max_tokens >= len(contexts)
    caches = runner.cache.kv_caches
    for k, v in caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in caches]
    rng = random.Random(len(contexts))
    metadata = _decode_step(runner, contexts, rng)
    ids = torch.tensor([rng.randrange(100, 49152) for _ in contexts])
    positions = torch.tensor(contexts)
    assert fused.accepts(metadata, len(contexts))
    results = []
    with torch.inference_mode(), forward_context(ForwardContext(metadata, caches)):
        for use_fused in (False, True):
            for (k, v), (k0, v0) in zip(caches, before):
                k.copy_(k0)
                v.copy_(v0)
            model.fused_decode = fused if use_fused else None
            hidden = model(ids, positions)                                   # (T, hidden)
            results.append((hidden, [(k.clone(), v.clone()) for k, v in caches]))
    model.fused_decode = fused
    (ref, ref_caches), (got, got_caches) = results
    # Both round to bf16 at the same points; a norm's sum order may move an element by an ulp.
    torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -6, atol=2 ** -6)
    assert (got != ref).float().mean() < 0.05
    for (k, v), (rk, rv) in zip(got_caches, ref_caches):
        torch.testing.assert_close(k, rk, rtol=2 ** -6, atol=2 ** -6)
        torch.testing.assert_close(v, rv, rtol=2 ** -6, atol=2 ** -6)


def test_engine_decodes_through_fused_layers(bf16_llm):
    """Whole generations of 2 and 9 prompts: their decode steps take the C layers, and the tokens
    are those of the op-by-op path (the tiny models' logits are far from ties)."""
    runner = bf16_llm.llm_engine.runner
    fused = runner.fused_decode
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 40, 17, 90, 8, 61, 5, 70, 30], seed=5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = []
    for use_fused in (False, True):
        runner.fused_decode = runner.model.model.fused_decode = fused if use_fused else None
        before = runner.graph_stats.fused_decode_steps
        outputs.append([o.outputs[0].token_ids for o in bf16_llm.generate(prompts[:2], params, use_tqdm=False)
                        + bf16_llm.generate(prompts, params, use_tqdm=False)])
        assert (runner.graph_stats.fused_decode_steps > before) == use_fused
    assert outputs[0] == outputs[1]
