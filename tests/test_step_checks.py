"""A step's block tables, slots and lengths are checked against the cache before any kernel runs:
every out-of-range value a scheduler or cache bug could make raises an error naming it, the
cache is untouched, and the engine fails that step (not the process) and goes on."""

import dataclasses

import pytest
import torch

from tests.utils import random_prompts
from vllm import LLM, SamplingParams
from vllm.attention.backends.abstract import SeqSpan, StepBatch
from vllm.attention.backends.cpu_metadata import build_attention_metadata
from vllm.attention.backends.cpu_metadata_checks import check_metadata
from vllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from vllm.model_executor.layers import cpu_gemv
from vllm.worker.step_checks import check_step

BLOCK = 16
NUM_BLOCKS = 64


# ---------------------------------------------------------------- the scheduler's step

def share(table: list[int], start: int, num_tokens: int) -> ScheduledSequence:
    return ScheduledSequence(request_id="r", token_ids=[7] * num_tokens, start_position=start,
                             block_table=table, sample=True, sampling_params=SamplingParams())


BAD_STEPS = {
    "table entry = block count": (SchedulerOutput([share([0, NUM_BLOCKS], 20, 1)], 1),
                                  rf"block table entry {NUM_BLOCKS} outside the cache's blocks \[0, {NUM_BLOCKS}\)"),
    "table entry -1": (SchedulerOutput([share([3, -1], 20, 1)], 1), r"block table entry -1 outside"),
    "length past its table": (SchedulerOutput([share([3, 4], 32, 1)], 1),
                              r"33 tokens, but its block table holds 2 blocks of 16"),
    "chunk past its table": (SchedulerOutput([share([3], 0, 17)], 0), r"17 tokens, but its block table holds 1"),
    "block copy past the cache": (SchedulerOutput([], 0, blocks_to_copy=[(2, NUM_BLOCKS)]),
                                  rf"block copy \(2, {NUM_BLOCKS}\) outside"),
}


@pytest.mark.parametrize("case", BAD_STEPS)
def test_check_step_names_each_out_of_range_value(case):
    step, message = BAD_STEPS[case]
    with pytest.raises(IndexError, match=message):
        check_step(step, NUM_BLOCKS, BLOCK)


def test_check_step_passes_a_valid_step():
    check_step(SchedulerOutput([share([0, NUM_BLOCKS - 1], 20, 12), share([5], 15, 1)], 0,
                               blocks_to_copy=[(0, NUM_BLOCKS - 1)]), NUM_BLOCKS, BLOCK)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    # bf16: on CPUs that build them, the C kernels and fused layers run the steps.
    return LLM(tiny_checkpoints["llama"], dtype="bfloat16", max_model_len=256, block_size=BLOCK,
               num_gpu_blocks_override=NUM_BLOCKS, max_num_batched_tokens=32, enforce_eager=True)


@pytest.mark.parametrize("case", BAD_STEPS)
def test_a_bad_step_raises_before_any_kernel_writes_the_cache(llm, case):
    runner = llm.llm_engine.runner
    before = [t.clone() for pair in runner.cache.kv_caches for t in pair]
    step, message = BAD_STEPS[case]
    with pytest.raises(IndexError, match=message):
        runner.execute_model(step)
    after = [t for pair in runner.cache.kv_caches for t in pair]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("times", [1, 100], ids=["once", "always"])
def test_the_engine_fails_a_corrupt_step_and_goes_on(llm, times):
    """A block-table entry equal to the block count, as a cache bug would make it: the step is
    taken back; once, the request recomputes to its tokens; always, it ends with the error."""
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": random_prompts([50], seed=2)[0]}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    schedule, corrupted = engine.scheduler.schedule, []

    def corrupt():
        step = schedule()
        if step.scheduled and len(corrupted) < times and step.scheduled[0].start_position > 0:
            first = step.scheduled[0]
            table = [NUM_BLOCKS, *first.block_table[1:]]
            step.scheduled[0] = dataclasses.replace(first, block_table=table)
            corrupted.append(first.request_id)
        return step

    engine.scheduler.schedule = corrupt
    try:
        out = llm.generate(prompt, params, use_tqdm=False)[0]
    finally:
        del engine.scheduler.schedule
    if times == 1:
        assert out.outputs[0].token_ids == want and out.error is None
    else:
        assert out.outputs[0].finish_reason == "error" and "block table entry 64" in out.error
    bm = engine.scheduler.block_manager
    assert not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want


# ---------------------------------------------------------------- the backend's metadata

PAD = NUM_BLOCKS  # the pad block: the cache has NUM_BLOCKS + 1 blocks


def valid_metadata():
    """Two decodes (contexts 20 and 40) and a prefill chunk of 6 tokens after 10 cached, padded to 16 tokens."""
    spans = [SeqSpan(0, 1, 20, [1, 2]), SeqSpan(1, 1, 40, [3, 4, 5]), SeqSpan(2, 6, 10, [6])]
    slots = [1 * BLOCK + 4, 5 * BLOCK + 8] + [6 * BLOCK + p for p in range(10, 16)] + [PAD * BLOCK] * 8
    return build_attention_metadata(spans, 2, slots, BLOCK, 2, None, PAD, torch.device("cpu"),
                                    paged_decode=True, paged_prefill=True)


def _set(path: str, index, value):
    def corrupt(meta):
        obj = meta
        *parents, name = path.split(".")
        for p in parents:
            obj = getattr(obj, p)
        getattr(obj, name)[index] = value
    return corrupt


BAD_METADATA = {
    # cpu_paged_decode.c
    "decode table entry = block count + pad": (_set("paged_decodes.block_tables", (1, 0), PAD + 1),
                                               rf"decode block table entry {PAD + 1} outside \[0, {PAD + 1}\)"),
    "decode table entry -1": (_set("paged_decodes.block_tables", (0, 1), -1), r"decode block table entry -1"),
    "decode length past its table": (_set("paged_decodes.seq_lens", 1, 3 * BLOCK + 1),
                                     rf"decode sequence length {3 * BLOCK + 1} outside \[1, {3 * BLOCK + 1}\)"),
    "decode length 0": (_set("paged_decodes.seq_lens", 0, 0), r"decode sequence length 0"),
    # llama_cpu_layers.c: the rotary and cache write, then attention
    "slot = slot count": (_set("slot_mapping", 3, (PAD + 1) * BLOCK), rf"slot {(PAD + 1) * BLOCK} outside"),
    "slot -1": (_set("slot_mapping", 15, -1), r"slot -1 outside"),
    "prefill table entry = block count + pad": (_set("paged_prefills.block_tables", (0, 0), PAD + 1),
                                                r"prefill block table entry 65"),
    "prefill context past its table": (_set("paged_prefills.context_lens", 0, 11),
                                       r"prefill keys \(context \+ query\) 17 outside \[1, 17\)"),
    "prefill chunk past the step": (_set("paged_prefills.token_offsets", 0, 12),
                                    r"prefill end \(offset \+ query\) 18 outside \[1, 17\)"),
    "prefill query length 0": (_set("paged_prefills.query_lens", 0, 0), r"prefill query length 0"),
}


def test_valid_metadata_passes():
    check_metadata(valid_metadata(), PAD + 1, BLOCK)


@pytest.mark.parametrize("case", BAD_METADATA)
def test_check_metadata_names_each_out_of_range_value(case):
    corrupt, message = BAD_METADATA[case]
    meta = valid_metadata()
    corrupt(meta)
    with pytest.raises(IndexError, match=message):
        check_metadata(meta, PAD + 1, BLOCK)


@pytest.mark.parametrize("row, message", [(16, r"decode row 16 outside \[0, 16\)"), (-1, r"decode row -1")])
def test_check_metadata_names_a_decode_row_outside_the_step(row, message):
    """Queries by role: a chunk's prompt positions 10-11 for the prefill kernel, its generated
    positions 12-15 in rows 3-6 for the decode kernel, which the C layers gather by row."""
    spans = [SeqSpan(0, 1, 20, [1, 2], num_prompt_tokens=10), SeqSpan(1, 6, 10, [6], num_prompt_tokens=12)]
    slots = [1 * BLOCK + 4] + [6 * BLOCK + p for p in range(10, 16)] + [PAD * BLOCK] * 9
    meta = build_attention_metadata(spans, 1, slots, BLOCK, 2, None, PAD, torch.device("cpu"),
                                    paged_decode=True, paged_prefill=True)
    assert meta.paged_decodes.rows.tolist() == [0, 3, 4, 5, 6]
    check_metadata(meta, PAD + 1, BLOCK)
    meta.paged_decodes.rows[2] = row
    with pytest.raises(IndexError, match=message):
        check_metadata(meta, PAD + 1, BLOCK)


def test_the_cpu_backend_checks_the_metadata_it_builds(llm):
    """A table entry past even the pad block, as a bug in the metadata builder or a new caller of
    the backend would pass it: build_metadata refuses it before any layer reads it."""
    backend = llm.llm_engine.runner.attn_backend
    batch = StepBatch([SeqSpan(0, 1, 20, [1, PAD + 1])], 1, [20], [BLOCK + 4])
    with pytest.raises(IndexError, match=r"block table entry 65 outside \[0, 65\)"):
        backend.build_metadata(batch)


@pytest.mark.skipif(cpu_gemv.max_rows() == 0, reason="the C GEMV is not built here (no AVX512-BF16)")
def test_gemv_refuses_a_bias_shorter_than_its_output():
    x, weight = torch.randn(2, 64).bfloat16(), torch.randn(48, 64).bfloat16()
    with pytest.raises(ValueError, match=r"bias of shape \(32,\) for a product of 48 outputs"):
        cpu_gemv.gemv(x, weight, torch.randn(32).bfloat16())
