"""The C decoder layers (llama_cpu_layers.c) against the op-by-op layers, for steps of decodes,
prefill chunks and both."""

import random

import pytest
import torch

from tests.utils import build_tiny_checkpoint, on_tile_gemm_copy, random_prompts, tokens_op_by_op_then_fused
from vllm import LLM, SamplingParams
from vllm.attention.backends.abstract import SeqSpan
from vllm.attention.backends.cpu_metadata import build_attention_metadata
from vllm.forward_context import ForwardContext, forward_context
from vllm.model_executor.layers.linear import PACKED_MAX_ROWS
from vllm.model_executor.models.llama_cpu_layers import FusedLayers
from vllm.platforms.cpu import cpu_flags

BLOCK = 16

pytestmark = pytest.mark.skipif("avx512_bf16" not in cpu_flags(),
                                reason="the C GEMV, and so the C layers, need AVX512-BF16")


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def bf16_llm(request, tiny_checkpoints) -> LLM:
    return LLM(tiny_checkpoints[request.param], dtype="bfloat16", max_model_len=512, block_size=BLOCK,
               num_gpu_blocks_override=512, enforce_eager=True)


def _step(runner, contexts: list[int], chunks: list[tuple[int, int]], rng: random.Random,
          prompts: list[int] | None = None):
    """Metadata and positions for one decode per context length, then one prefill chunk per
    (query_len, context_len), on distinct random blocks; `prompts`: each one's prompt length."""
    blocks = list(range(1, runner.cache.kv_caches[0][0].shape[0]))
    rng.shuffle(blocks)
    spans, slots, positions = [], [], []
    for i, (query_len, ctx) in enumerate([(1, c) for c in contexts] + chunks):
        table = [blocks.pop() for _ in range((ctx + query_len - 1) // BLOCK + 1)]
        spans.append(SeqSpan(len(positions), query_len, ctx, table, prompts[i] if prompts else None))
        for pos in range(ctx, ctx + query_len):
            positions.append(pos)
            slots.append(table[pos // BLOCK] * BLOCK + pos % BLOCK)
    metadata = build_attention_metadata(spans, len(contexts), slots, BLOCK, runner.attn_backend.heads_per_kv,
                                        runner.attn_backend.sliding_window, runner.cache.pad_block, torch.device("cpu"),
                                        runner.attn_backend.dtype, split_prefill=True, paged_decode=True,
                                        paged_prefill=runner.attn_backend.paged_prefill)
    return metadata, torch.tensor(positions)


def _assert_fused_matches_op_by_op(runner, contexts: list[int], chunks: list[tuple[int, int]],
                                   rng: random.Random, prompts: list[int] | None = None):
    """Runs one step (see _step) through the op-by-op layers and through C layers built under the
    tile GEMM copy in use (they keep the GEMV's rows of their build, and on AMX the GEMV keeps 1-4
    rows, on the AVX512 copy the tile GEMM takes them), from the same random caches: the hidden
    states and the cache writes must agree (bf16, or float32 for a float32 model). Returns the
    step's metadata."""
    model, fused = runner.model.model, FusedLayers.build(runner.model.model)
    metadata, positions = _step(runner, contexts, chunks, rng, prompts)
    ids = torch.tensor([rng.randrange(100, 49152) for _ in range(positions.shape[0])])
    assert fused.accepts(metadata, positions.shape[0])
    assert (metadata.paged_prefills is not None) == bool(chunks) or prompts is not None
    caches = runner.cache.kv_caches
    for k, v in caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in caches]
    results = []
    with torch.inference_mode(), forward_context(ForwardContext(metadata, runner.attn_backend)):
        for use_fused in (False, True):
            for (k, v), (k0, v0) in zip(caches, before):
                k.copy_(k0)
                v.copy_(v0)
            model.fused_layers = fused if use_fused else None
            hidden = model(ids, positions)                                   # (T, hidden)
            results.append((hidden, [(k.clone(), v.clone()) for k, v in caches]))
    model.fused_layers = runner.attn_backend.fused_layers
    (ref, ref_caches), (got, got_caches) = results
    assert got.dtype == ref.dtype == runner.attn_backend.dtype
    if got.dtype == torch.float32:  # float32's roundings, of a norm's sum and SiLU's exp in another order
        tolerance = {"rtol": 1e-4, "atol": 1e-4}
    else:  # both round to bf16 at the same points; a norm's sum order may move an element by an ulp
        tolerance = {"rtol": 2 ** -6, "atol": 2 ** -6}
        assert (got != ref).float().mean() < 0.05
    torch.testing.assert_close(got.float(), ref.float(), **tolerance)
    for (k, v), (rk, rv) in zip(got_caches, ref_caches):
        torch.testing.assert_close(k, rk, **tolerance)
        torch.testing.assert_close(v, rv, **tolerance)
    return metadata


@pytest.fixture(params=["amx", "avx512"])
def tile_copy(request):
    """Products past the GEMV's rows on each copy of the tile GEMM this CPU has (with
    AVX512-BF16, which the C layers need, it has the AVX512 one at least)."""
    yield from on_tile_gemm_copy(request.param)


@pytest.mark.parametrize("contexts", [[0], [37], [5, 200, 16], [130, 1, 64, 300],
                                      [3, 90, 17, 250, 64, 0, 33],
                                      [11 * i % 170 for i in range(16)], [7 * i % 150 for i in range(32)]])
def test_eager_steps_match_op_by_op(bf16_llm, contexts, tile_copy):
    """Same hidden states and the same cache writes, for 1-32 decodes (the GEMV up to 4 rows, the
    tile GEMM's AMX or AVX512 copy above) at contexts that cross blocks and (Mistral) the sliding
    window of 96; past keys are random."""
    runner = bf16_llm.llm_engine.runner
    fused = runner.attn_backend.fused_layers
    assert fused is not None and fused.max_tokens == PACKED_MAX_ROWS
    _assert_fused_matches_op_by_op(runner, contexts, [], random.Random(len(contexts)))


def test_engine_decodes_through_fused_layers(bf16_llm):
    """Whole generations of 2 and 9 prompts: their decode steps take the C layers, and the tokens
    are those of the op-by-op path (the tiny models' logits are far from ties)."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 40, 17, 90, 8, 61, 5, 70, 30], seed=5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = tokens_op_by_op_then_fused(
        bf16_llm, lambda: [o.outputs[0].token_ids for o in bf16_llm.generate(prompts[:2], params, use_tqdm=False)
                           + bf16_llm.generate(prompts, params, use_tqdm=False)])
    assert outputs[0] == outputs[1]


def test_each_step_writes_the_caches_it_is_given(bf16_llm):
    """The C layers take a list of caches' addresses once: a step given another list writes its
    keys and values into that one, and leaves the caches of the steps before untouched."""
    runner = bf16_llm.llm_engine.runner
    model, fused = runner.model.model, FusedLayers.build(runner.model.model)
    metadata, positions = _step(runner, [5, 40], [], random.Random(3))
    slots = metadata.slot_mapping
    first = runner.cache.kv_caches
    second = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in first]
    with torch.inference_mode(), forward_context(ForwardContext(metadata, runner.attn_backend)):
        fused(model.embed_tokens(torch.tensor([7, 11])), positions, metadata, first)
        kept = [(k.clone(), v.clone()) for k, v in first]
        fused(model.embed_tokens(torch.tensor([300, 5000])), positions, metadata, second)

    def rows(cache: torch.Tensor) -> torch.Tensor:                            # (T, KVH, D)
        return cache.flatten(0, 1)[slots]

    for (k, v), (k0, v0), (k2, v2) in zip(first, kept, second, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
        assert (rows(k2) != 0).any() and (rows(v2) != 0).any()
        assert not torch.equal(rows(k2), rows(k0))


def test_a_position_past_the_rotary_tables_is_refused(bf16_llm):
    """A position without a row in the rotary tables raises IndexError (as the op-by-op path's
    lookup in them does) before any layer writes the caches or reads past the tables."""
    runner = bf16_llm.llm_engine.runner
    model, fused = runner.model.model, FusedLayers.build(runner.model.model)
    metadata, _ = _step(runner, [5, 40], [], random.Random(4))
    caches = runner.cache.kv_caches
    before = [(k.clone(), v.clone()) for k, v in caches]
    rows = model.rotary.cos.shape[0]
    with torch.inference_mode(), forward_context(ForwardContext(metadata, runner.attn_backend)):
        for bad in (rows, -1):
            with pytest.raises(IndexError, match=f"outside the rotary tables' {rows} rows"):
                fused(model.embed_tokens(torch.tensor([7, 11])), torch.tensor([3, bad]), metadata, caches)
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def bf16_llm_d64(request, tokenizer_dir, tmp_path_factory) -> LLM:
    """head_dim 64, so that prefill chunks take the C prefill kernel and the C layers with it."""
    path = build_tiny_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)), tokenizer_dir,
                                 hidden_size=256)
    llm = LLM(path, dtype="bfloat16", max_model_len=512, block_size=BLOCK, num_gpu_blocks_override=512,
              enforce_eager=True, enable_chunked_prefill=True, max_num_batched_tokens=64)
    if not llm.llm_engine.runner.attn_backend.fused_layers.takes_prefills:
        pytest.skip("the C prefill kernel needs AVX512-BF16")
    return llm


@pytest.mark.parametrize("contexts,chunks", [
    ([], [(4, 0)]), ([], [(1, 60)]), ([7], [(3, 100)]), ([], [(2, 15), (2, 0)]), ([130], [(1, 0), (2, 200)]),
    ([], [(37, 0)]), ([5, 200], [(40, 0), (100, 33)]), ([], [(256, 0)]),
    ([3 * i for i in range(8)], [(248, 150)]), ([70], [(120, 50), (2, 95)]),
    ([0, 17, 300], [(300, 10), (150, 0)]),
])
def test_fused_mixed_steps_match_op_by_op(bf16_llm_d64, contexts, chunks, tile_copy):
    """Same hidden states and cache writes for steps of prefill chunks, with and without decodes
    before them: chunks with and without context, across blocks, past (Mistral) the window of
    96, on the GEMV (1-4 rows) and the tile GEMM's AMX or AVX512 copy (up to 456 rows); past
    keys are random."""
    runner = bf16_llm_d64.llm_engine.runner
    _assert_fused_matches_op_by_op(runner, contexts, chunks, random.Random(len(contexts) + len(chunks)))


def test_fused_steps_of_queries_by_role_match_op_by_op(bf16_llm_d64, tile_copy):
    """With the prompts' lengths, queries go to the kernel of their position's role: here a
    prompt's last token among the decodes (context 7 of an 8-token prompt) to the prefill kernel,
    and the generated positions 25-31 of a recomputed request's chunk to the decode kernel, in
    rows the C layers gather for it and scatter back."""
    runner = bf16_llm_d64.llm_engine.runner
    metadata = _assert_fused_matches_op_by_op(runner, [40, 7, 90], [(12, 20), (9, 0)], random.Random(7),
                                              prompts=[10, 8, 30, 25, 9])
    assert metadata.paged_decodes.rows.tolist() == [0, 2, *range(8, 15)]
    assert metadata.paged_prefills.token_offsets.tolist() == [1, 3, 15]


def test_steps_past_the_packed_rows_are_refused(bf16_llm_d64):
    """The C layers take steps of up to PACKED_MAX_ROWS tokens; the runner keeps larger ones op
    by op."""
    runner = bf16_llm_d64.llm_engine.runner
    fused, rng = runner.attn_backend.fused_layers, random.Random(0)
    for tokens in (PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1):
        metadata, positions = _step(runner, [40], [(tokens - 201, 0), (200, 16)], rng)
        assert fused.accepts(metadata, positions.shape[0]) == (tokens == PACKED_MAX_ROWS)


class _Recording:
    """Wraps the C layers and records, per step they run, whether it held prefill chunks."""

    def __init__(self, inner) -> None:
        self.inner, self.steps = inner, []
        self.max_tokens = inner.max_tokens

    def accepts(self, metadata, num_tokens: int) -> bool:
        return self.inner.accepts(metadata, num_tokens)

    def __call__(self, hidden, positions, metadata, kv_caches):
        self.steps.append(metadata.paged_prefills is not None)
        return self.inner(hidden, positions, metadata, kv_caches)


def test_engine_runs_chunked_prefill_through_fused_layers(bf16_llm_d64):
    """Chunked generations (prompts up to 150 tokens) run their prefill chunks and mixed steps on
    the C layers, and give the op-by-op path's tokens."""
    runner = bf16_llm_d64.llm_engine.runner
    fused = runner.attn_backend.fused_layers
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 150, 17, 90, 8, 61, 120], seed=7)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = []
    for use_fused in (False, True):
        recording = _Recording(fused) if use_fused else None
        runner.attn_backend.fused_layers = runner.model.model.fused_layers = recording
        assert bf16_llm_d64.reset_prefix_cache()  # the second run computes every prompt again
        outputs.append([o.outputs[0].token_ids for o in bf16_llm_d64.generate(prompts, params, use_tqdm=False)])
    runner.attn_backend.fused_layers = runner.model.model.fused_layers = fused
    assert sum(recording.steps) >= 5 and not all(recording.steps)
    assert outputs[0] == outputs[1]

