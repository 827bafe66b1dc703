"""The Gaudi path on CPU tensors, through the test double of `habana_frameworks` (tests/hpu_double):
the real HpuPlatform and HPU attention backend, in lazy and in compile mode.

Same greedy tokens as transformers (float32) at every budget and block size; and the static-shape
audit (tests/shape_audit.py): after warm-up, a workload with decodes, several chunks with long
contexts, preemption, n > 1 forks, prompt logprobs and prompts found in the prefix cache makes Gaudi
compile nothing more; nor do seeded random loads (arrivals while others run, an abort, the smallest
cache), whose greedy requests get the tokens the CPU path gives each alone.
"""

import dataclasses
import random
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.shape_audit import SegmentAudit, new_since, snapshot
from tests.utils import hf_greedy, random_prompts, smollm2_path
from vllm import LLM, SamplingParams
from vllm.platforms.hpu import HpuPlatform
from vllm.worker.cache_engine import CacheEngine

HPU_DOUBLE = Path(__file__).parent / "hpu_double"
PROMPT_LENGTHS = [1, 7, 16, 17, 45, 129, 200, 300]
MAX_TOKENS = 32
_HF = {}


@pytest.fixture(params=["lazy", "compile"])
def hpu(request, monkeypatch):
    """Installs the double in the given mode; yields its recorder. Tensors stay on the host."""
    monkeypatch.syspath_prepend(str(HPU_DOUBLE))
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1" if request.param == "lazy" else "0")
    monkeypatch.setattr(HpuPlatform, "device", property(lambda self: torch.device("cpu")))
    from habana_frameworks.recorder import RECORDER

    RECORDER.reset()
    torch._dynamo.reset()
    yield RECORDER
    RECORDER.reset()
    # Later tests must not find a Gaudi stack (device="auto" looks for the top package); the
    # double's submodules stay imported, so its dynamo backend keeps reporting to RECORDER.
    del sys.modules["habana_frameworks"]


def _reference(path: str, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Transformers' greedy tokens, once per model and prompts for both modes of the double."""
    key = (path, tuple(map(tuple, prompts)), max_tokens)
    if key not in _HF:
        _HF[key] = hf_greedy(path, prompts, max_tokens)
    return _HF[key]


def _generate(llm: LLM, lengths: list[int] = PROMPT_LENGTHS) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in random_prompts(lengths)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# Lazy mode: every budget at both block sizes; compile mode, slower to warm up: every budget at
# one block size, alternating. The model kind rotates so that each meets several budgets.
_KINDS = ["llama", "qwen2", "mistral"]
_BUDGETS = (4, 16, 64, 512)
_CASES = ([("lazy", budget, block, _KINDS[i % 3])
           for i, (budget, block) in enumerate((b, bs) for b in _BUDGETS for bs in (16, 128))]
          + [("compile", budget, (16, 128)[i % 2], _KINDS[i % 3]) for i, budget in enumerate(_BUDGETS)])


@pytest.mark.parametrize("hpu,budget,block_size,kind", _CASES, indirect=["hpu"])
def test_greedy_matches_transformers(hpu, tiny_checkpoints, budget, block_size, kind):
    path = tiny_checkpoints[kind]
    llm = LLM(path, device="hpu", dtype="float32", max_model_len=512, block_size=block_size,
              max_num_batched_tokens=budget, max_num_seqs=min(budget, 8), enforce_eager=False)
    stats = llm.llm_engine.graph_stats
    assert _generate(llm) == _reference(path, random_prompts(PROMPT_LENGTHS)), kind
    assert stats.compiles_after_warmup == 0 and stats.unwarmed_steps == 0
    assert {"prefill_attention", "decode_attention", "logits"} <= set(stats.device_graphs)
    assert not hpu.forbidden


def test_smollm2_matches_transformers(hpu):
    """The real model (GQA, 30 layers) in float32 through the HPU path."""
    path = smollm2_path()
    prompts = [[1, *p] for p in random_prompts([5, 40, 100], seed=3, vocab=49152)]
    # Few buckets: each warm-up step runs all 30 layers.
    llm = LLM(device="hpu", dtype="float32", max_model_len=128, block_size=16, max_num_batched_tokens=32,
              max_num_seqs=2, enforce_eager=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == _reference(path, prompts, 12)
    assert llm.llm_engine.graph_stats.compiles_after_warmup == 0


def _audited_engine(hpu, lazy: bool, path: str, monkeypatch) -> tuple[LLM, SegmentAudit | None]:
    """An engine whose model, logits head and block copies run under the segment audit (lazy
    mode; in compile mode dynamo would not compile under a dispatch mode, and the compiles
    themselves are what the double records)."""
    audit = SegmentAudit(hpu) if lazy else None
    if audit is not None:
        capture_model, capture_region = HpuPlatform.capture_model, HpuPlatform.capture_region
        monkeypatch.setattr(HpuPlatform, "capture_model", lambda self, m: audit.audited(capture_model(self, m)))
        # Attention regions run inside the model; the logits head runs on its own.
        monkeypatch.setattr(HpuPlatform, "capture_region", lambda self, name, m: (
            audit.audited(capture_region(self, name, m)) if name == "logits" else capture_region(self, name, m)))
        monkeypatch.setattr(CacheEngine, "copy_blocks", audit.audited(CacheEngine.copy_blocks))
    # A cache of 16 blocks of 16 for up to 8 sequences of up to 256 tokens forces preemption (a
    # request starts when its prompt fits, and the running ones outgrow the rest);
    # two partial prefills give steps with several chunks.
    llm = LLM(path, device="hpu", dtype="float32", max_model_len=256, block_size=16, num_gpu_blocks_override=16,
              max_num_batched_tokens=64, max_num_seqs=8, max_num_partial_prefills=2, enforce_eager=False)
    return llm, audit


def _workload(seed: int) -> tuple[list[dict], list[SamplingParams]]:
    """Prompts of 1 to 250 tokens; greedy and seeded samples, n = 2 forks, prompt logprobs."""
    rng = random.Random(seed)
    lengths = [rng.choice([1, 2, rng.randint(3, 60), rng.randint(100, 250)]) for _ in range(12)]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(lengths, seed=seed)]
    params = []
    for n in lengths:
        room = 256 - n
        params.append(SamplingParams(
            temperature=rng.choice([0.0, 0.8]), seed=rng.randint(0, 99), n=rng.choice([1, 1, 2]),
            max_tokens=rng.randint(1, min(room, 40)), ignore_eos=True,
            prompt_logprobs=rng.choice([None, None, 2]), logprobs=rng.choice([None, 1])))
    return prompts, params


def _cached_workload(prompts: list[dict]) -> tuple[list[dict], list[SamplingParams]]:
    """Prompts that begin like earlier ones: the longest again (all its blocks but the last found
    in the cache), its first 3 blocks and 1 block, each with tokens of its own."""
    longest = max((p["prompt_token_ids"] for p in prompts), key=len)
    own = random_prompts([5, 30], seed=99)
    cached = [longest, longest[:48] + own[0], longest[:16] + own[1]]
    return ([{"prompt_token_ids": p} for p in cached],
            [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True) for _ in cached])


def test_no_new_shape_after_warmup(hpu, request, tiny_checkpoints, monkeypatch):
    lazy = request.node.callspec.params["hpu"] == "lazy"
    llm, audit = _audited_engine(hpu, lazy, tiny_checkpoints["llama"], monkeypatch)
    warmed = snapshot(hpu, audit)
    assert warmed.graph_keys and (audit is None or audit.segments)
    prompts, params = _workload(1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.stats.num_preemptions > 0
    assert any(len(o.outputs) == 2 for o in outs) and any(o.prompt_logprobs for o in outs)
    # Cached context is more context blocks: a first chunk after a cached prefix of up to 15
    # blocks runs in the warmed buckets too.
    cached_prompts, cached_params = _cached_workload(prompts)
    # The workload's later requests may have evicted the longest prompt's blocks: run it once more.
    llm.generate(cached_prompts[:1], cached_params[:1], use_tqdm=False)
    cached = llm.generate(cached_prompts, cached_params, use_tqdm=False)
    assert [o.num_cached_tokens > 0 for o in cached] == [True, True, True]
    assert new_since(warmed, hpu, audit) == {"graphs": [], "compiles": [], "lazy_segments": [],
                                            "forbidden_ops": []}
    stats = engine.graph_stats
    assert stats.compiles_after_warmup == 0 and stats.unwarmed_steps == 0
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("unpadded", ["context_blocks", "decode_blocks", "rows"])
def test_audit_catches_an_unpadded_tensor(hpu, request, tiny_checkpoints, monkeypatch, unpadded):
    """The audit can fail: with one kind of per-step tensor left at its own size (a bucket for
    every size), the workload shows Gaudi shapes that warm-up did not, and the engine counts them."""
    lazy = request.node.callspec.params["hpu"] == "lazy"
    llm, audit = _audited_engine(hpu, lazy, tiny_checkpoints["llama"], monkeypatch)
    warmed = snapshot(hpu, audit)
    backend = llm.llm_engine.runner.attn_backend
    if unpadded == "rows":
        monkeypatch.setattr(backend, "padded_rows", lambda n, num_tokens: n)
    else:
        every_size = dataclasses.replace(backend.buckets, **{unpadded: list(range(1, 1024))})
        monkeypatch.setattr(backend, "buckets", every_size)
    prompts, params = _workload(2)
    llm.generate(prompts, params, use_tqdm=False)
    new = new_since(warmed, hpu, audit)
    assert new["graphs"] or new["compiles"] or new["lazy_segments"]
    assert llm.llm_engine.graph_stats.compiles_after_warmup > 0


@pytest.mark.parametrize("hpu", ["lazy"], indirect=True)
def test_warmup_compiles_what_the_bucket_grid_counts(hpu, tiny_checkpoints, monkeypatch):
    """benchmarks/habana_bucket_grid.py counts graphs with HpuBuckets.graph_counts: in lazy mode,
    which shows every graph to the audit, warm-up compiles exactly those, region by region."""
    llm, audit = _audited_engine(hpu, True, tiny_checkpoints["llama"], monkeypatch)
    runner = llm.llm_engine.runner
    want = runner.attn_backend.buckets.graph_counts(runner.graph_stats.buckets)
    by_module = Counter(key[1] for key in hpu.graph_keys)
    assert by_module == {"PrefillAttention": want["prefill_attention"], "DecodeAttention": want["decode_attention"],
                         "LogitsHead": want["logits"]}
    assert len(audit.segments) == want["body"] + want["combine"] + want["block_copies"]


def _random_load(rng: random.Random) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 1 to 130 tokens, some sharing a prefix; mostly greedy (compared with the CPU
    path), some n = 2 seeded samples and prompt logprobs."""
    shared = [rng.randrange(100, 49000) for _ in range(rng.choice([16, 40, 130]))]
    load = []
    for _ in range(rng.randrange(5, 10)):
        prompt = (shared[:rng.randrange(0, len(shared) + 1)] if rng.random() < 0.5 else []) + \
                 [rng.randrange(100, 49000) for _ in range(rng.randrange(1, 120))]
        greedy = rng.random() < 0.7
        load.append((prompt, SamplingParams(
            temperature=0 if greedy else 0.8, seed=None if greedy else rng.randrange(100), n=1 if greedy else 2,
            max_tokens=rng.randrange(1, min(60, 256 - len(prompt))), ignore_eos=True, logprobs=1,
            prompt_logprobs=rng.choice([None, None, 1]))))
    return load


@pytest.mark.parametrize("hpu", ["lazy"], indirect=True)
@pytest.mark.parametrize("seed", [2, 6, 13, 17])  # loads with both preemptions and prefix hits
def test_a_random_load_compiles_nothing_after_warmup_and_matches_the_cpu_path(hpu, tiny_checkpoints, seed):
    """Random budgets, block sizes and cache sizes, arrivals while others run, an abort, prefix
    hits and preemptions: nothing is compiled after warm-up, every block comes back, and each
    greedy request has the tokens (and, within float32 rounding, the logprobs) that the CPU path
    gives it alone. (Seeded samples are only run: a logit that differs in its last bits may move
    an inverse-CDF draw to the next token.)"""
    rng = random.Random(seed)
    kind = ("llama", "qwen2", "mistral")[seed % 3]
    block_size = (16, 128)[seed % 2]
    # The smallest cache that holds max_model_len: the load outgrows it.
    llm = LLM(tiny_checkpoints[kind], device="hpu", dtype="float32", max_model_len=256, block_size=block_size,
              max_num_batched_tokens=rng.choice([16, 32, 64]), max_num_seqs=8,
              num_gpu_blocks_override=256 // block_size, max_num_partial_prefills=rng.choice([1, 2]),
              enforce_eager=False)
    engine = llm.llm_engine
    load = _random_load(rng)
    pending, outs, aborted = list(range(len(load))), {}, None
    while pending or engine.has_unfinished_requests():
        while pending and (rng.random() < 0.4 or not engine.has_unfinished_requests()):
            i = pending.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": load[i][0]}, load[i][1])
        if aborted is None and engine.has_unfinished_requests() and rng.random() < 0.05:
            aborted = next(iter(engine.requests))
            engine.abort_request(aborted)
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    stats, bm = engine.graph_stats, engine.scheduler.block_manager
    assert stats.compiles_after_warmup == 0 and stats.unwarmed_steps == 0 and not hpu.forbidden
    assert bm.num_free_blocks == bm.num_blocks
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.num_prefix_cache_hits > 0
    cpu = LLM(tiny_checkpoints[kind], dtype="float32", max_model_len=256, block_size=16, enforce_eager=True,
              kv_cache_memory_bytes=16 * 2**20)
    compared = 0
    for i, (prompt, params) in enumerate(load):
        if str(i) == aborted or not params.greedy:
            continue
        got = outs[str(i)]
        ref = cpu.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids, (i, len(prompt))
        for a, b in zip(got.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)
        if params.prompt_logprobs is not None:
            for a, b in zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
                assert all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in b.keys() & a.keys())
        compared += 1
    assert compared >= 2
