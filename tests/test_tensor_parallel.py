"""Tensor parallelism: TP=2 on worker processes gives the tokens of TP=1, and leaves no process.

The head split rule (vllm/distributed/partition.py) is unit-tested; the engine runs float32
greedy on tiny random Llamas whose heads split evenly (4 heads, 2 KV heads) and unevenly (9
heads, 3 KV heads, as SmolLM2: rank 0 holds 2 KV heads, rank 1 one), at chunked-prefill budgets
16 and 512, against the same engine with one rank.
"""

import asyncio
import gc
import os
import signal
import time

import pytest

from tests.utils import build_tiny_checkpoint, random_prompts
from vllm import LLM, AsyncLLMEngine, SamplingParams
from vllm.distributed.partition import HeadShard, attention_head_shard, split_range
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.exceptions import EngineDeadError
from vllm.platforms.cpu import CpuPlatform

PROMPT_LENGTHS = [3, 17, 40, 75]
MAX_TOKENS = 6


def test_split_range_covers_every_item_once():
    for size, parts in [(10, 2), (9, 2), (3, 2), (7, 3), (2, 2)]:
        ranges = [split_range(size, parts, i) for i in range(parts)]
        assert [s for s, _ in ranges] == [sum(n for _, n in ranges[:i]) for i in range(parts)]
        assert sum(n for _, n in ranges) == size
        assert max(n for _, n in ranges) - min(n for _, n in ranges) <= 1


@pytest.mark.parametrize("heads,kv_heads,tp,want", [
    (4, 2, 2, [HeadShard(0, 2, 0, 1), HeadShard(2, 2, 1, 1)]),
    # SmolLM2: whole KV-head groups, the first rank one group more.
    (9, 3, 2, [HeadShard(0, 6, 0, 2), HeadShard(6, 3, 2, 1)]),
    # Fewer KV heads than ranks: each KV head on two ranks, its query heads split between them.
    (4, 1, 2, [HeadShard(0, 2, 0, 1), HeadShard(2, 2, 0, 1)]),
    (8, 2, 4, [HeadShard(0, 2, 0, 1), HeadShard(2, 2, 0, 1), HeadShard(4, 2, 1, 1), HeadShard(6, 2, 1, 1)]),
    (4, 4, 1, [HeadShard(0, 4, 0, 4)]),
])
def test_attention_heads_split_by_kv_groups(heads, kv_heads, tp, want):
    shards = [attention_head_shard(heads, kv_heads, tp, rank) for rank in range(tp)]
    assert shards == want
    # Every query head once, next to the KV head it reads.
    group = heads // kv_heads
    for s in shards:
        assert s.q_start // group >= s.kv_start
        assert (s.q_start + s.num_heads - 1) // group < s.kv_start + s.num_kv_heads
    assert sorted(h for s in shards for h in range(s.q_start, s.q_start + s.num_heads)) == list(range(heads))


@pytest.mark.parametrize("heads,kv_heads,tp", [(3, 1, 2), (9, 3, 4)])
def test_unsplittable_heads_are_refused(heads, kv_heads, tp):
    with pytest.raises(ValueError, match=f"tensor_parallel_size={tp}"):
        for rank in range(tp):
            attention_head_shard(heads, kv_heads, tp, rank)


def test_timing_collectives_counts_the_all_reduces_inside_the_block():
    import torch
    import torch.distributed as dist

    from vllm.distributed import parallel_state, timing_collectives
    from vllm.executor.mp_executor import loopback_init_method

    dist.init_process_group("gloo", init_method=loopback_init_method(), world_size=1, rank=0)
    try:
        x = torch.ones(4, 8)  # 128 bytes
        parallel_state._all_reduce(x)
        with timing_collectives() as times:
            parallel_state._all_reduce(x)
            parallel_state._all_reduce(x[:2])
        parallel_state._all_reduce(x)
    finally:
        dist.destroy_process_group()
    assert times.calls == {"all_reduce": 2} and times.bytes == {"all_reduce": 128 + 64}
    assert times.seconds["all_reduce"] > 0


@pytest.fixture(scope="module")
def uneven_checkpoint(tmp_path_factory, tokenizer_dir) -> str:
    return build_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("tiny_9_3")), tokenizer_dir,
                                 hidden_size=72, num_heads=9, num_kv_heads=3)


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, uneven_checkpoint) -> dict[str, str]:
    return {"even": tiny_checkpoints["llama"], "uneven": uneven_checkpoint}


def test_engine_arguments_for_parallelism(checkpoints):
    config, _, _ = EngineArgs(model=checkpoints["uneven"], tensor_parallel_size=2).create_engine_config(CpuPlatform())
    assert config.parallel.distributed_executor_backend == "mp"
    assert [config.model.get_num_kv_heads(config.parallel.__class__(2, rank=r)) for r in (0, 1)] == [2, 1]
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        EngineArgs(model=checkpoints["even"], pipeline_parallel_size=2).create_engine_config(CpuPlatform())
    with pytest.raises(ValueError, match="distributed_executor_backend='uni'"):
        EngineArgs(model=checkpoints["even"], tensor_parallel_size=2,
                   distributed_executor_backend="uni").create_engine_config(CpuPlatform())
    with pytest.raises(ValueError, match="tensor_parallel_size=8"):  # 4 heads
        EngineArgs(model=checkpoints["even"], tensor_parallel_size=8).create_engine_config(CpuPlatform())


def _generate(llm: LLM) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in random_prompts(PROMPT_LENGTHS, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _engine(path: str, budget: int, tp: int, **kwargs) -> LLM:
    return LLM(path, dtype="float32", tensor_parallel_size=tp, max_num_batched_tokens=budget,
               max_num_seqs=4, block_size=16, max_model_len=256, kv_cache_memory_bytes=1 << 24, **kwargs)


def _alive(pid: int) -> bool:
    """Whether the process exists, a zombie included: the executor must reap (join) its workers."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pids: list[int], seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("budget", [16, 512])
@pytest.mark.parametrize("model", ["even", "uneven"])
def test_tp2_matches_tp1_and_leaves_no_process(checkpoints, model, budget):
    want = _generate(_engine(checkpoints[model], budget, tp=1))
    llm = _engine(checkpoints[model], budget, tp=2)
    pids = llm.llm_engine.model_executor.worker_pids
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    assert _generate(llm) == want
    assert llm.llm_engine.stats.num_failed_steps == 0
    del llm
    gc.collect()
    assert _wait_gone(pids) == []


def check_a_killed_worker_fails_pending_requests(llm: LLM) -> None:
    """Kills rank 1's process while two requests run: both fail within seconds with an error
    naming the rank, the engine is dead, and no worker process is left. Shared with the ray
    executor's test."""
    engine = llm.llm_engine
    pids = engine.model_executor.worker_pids
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    aengine = AsyncLLMEngine(engine)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def consume(request_id: str, prompt: list[int]) -> BaseException | None:
        try:
            async for _ in aengine.generate({"prompt_token_ids": prompt}, params, request_id):
                pass
        except Exception as error:
            return error
        return None

    async def run() -> tuple[list[BaseException | None], float]:
        tasks = [asyncio.create_task(consume(str(i), p))
                 for i, p in enumerate(random_prompts([60, 30], seed=4))]
        while engine.stats.num_steps < 2:  # both requests are running
            await asyncio.sleep(0.01)
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        errors = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
        return errors, time.monotonic() - start

    errors, seconds = asyncio.run(run())
    assert seconds < 10
    for error in errors:  # every pending request, with the reason
        assert isinstance(error, EngineDeadError)
        assert "TP rank 1" in str(error) and "died" in str(error)
    assert aengine.errored and engine.is_dead
    with pytest.raises(EngineDeadError):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
    assert _wait_gone(pids) == []  # the surviving rank's too
    engine.shutdown()  # idempotent after the executor stopped itself


def test_a_killed_worker_fails_pending_requests_and_the_engine_is_dead(checkpoints):
    check_a_killed_worker_fails_pending_requests(_engine(checkpoints["even"], 16, tp=2))
