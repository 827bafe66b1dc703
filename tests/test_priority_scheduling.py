"""The priority scheduling policy: requests wait and run in (priority, arrival) order, the worst
running request is preempted first (a better prompt mid-prefill takes the blocks of worse decodes
scheduled in the same step), tokens do not depend on the policy, and the engine, LLM and the
server refuse a priority the policy cannot serve."""

import asyncio
import random

import pytest

from tests.test_scheduler import FakeEngine, assert_block_partition, make_seq
from vllm import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from vllm.config import SchedulerConfig
from vllm.core.scheduler import Scheduler
from vllm.entrypoints.openai.protocol import CompletionRequest
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_engine import OpenAIServingError
from vllm.sequence import SequenceStatus


def _add(eng: FakeEngine, request_id: str, prompt_len: int, max_tokens: int, priority: int, arrival: float):
    seq = eng.add(request_id, prompt_len, max_tokens)
    seq.priority, seq.arrival_time = priority, arrival
    # The scheduler placed it when it was added: queue it again with its priority.
    eng.sched.waiting.remove(seq)
    eng.sched.policy.enqueue(eng.sched.waiting, seq)
    return seq


def _finish_order(eng: FakeEngine) -> list[str]:
    order = []
    while eng.sched.has_unfinished():
        eng.step()
        order += [rid for rid, seq in eng.seqs.items() if seq.is_finished and rid not in order]
    return order


@pytest.mark.parametrize("policy, expected", [("fcfs", ["queued first", "urgent", "arrived first"]),
                                              ("priority", ["urgent", "arrived first", "queued first"])])
def test_waiting_requests_start_in_the_policys_order(policy, expected):
    eng = FakeEngine(budget=16, max_num_seqs=1, policy=policy)
    # Two of equal priority whose arrival times (an add_request argument) cross their queuing
    # order: by priority, the earlier arrival goes first.
    for rid, priority, arrival in [("queued first", 5, 1.0), ("urgent", -1, 2.0), ("arrived first", 5, 0.5)]:
        _add(eng, rid, 8, 2, priority, arrival)
    assert _finish_order(eng) == expected


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_worst_running_request_is_preempted_first(policy):
    # Three decodes fill a small cache; the best one then needs a block.
    eng = FakeEngine(budget=16, max_num_seqs=4, num_blocks=6, block_size=4, policy=policy)
    best = _add(eng, "best", 4, 12, 0, 0.0)
    worst = _add(eng, "worst", 4, 12, 9, 1.0)
    newest = _add(eng, "newest", 4, 12, 1, 2.0)
    while not (best.num_preemptions or worst.num_preemptions or newest.num_preemptions):
        eng.step()
    preempted = [s.request_id for s in (best, worst, newest) if s.num_preemptions]
    # fcfs preempts the request admitted last, priority the one of the worst priority.
    assert preempted == (["newest"] if policy == "fcfs" else ["worst"])
    assert [s.request_id for s in eng.sched.running] == (["best", "worst"] if policy == "fcfs"
                                                         else ["best", "newest"])
    eng.run()
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in eng.seqs.values())


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_better_prompt_mid_prefill_takes_the_blocks_of_worse_decodes(policy):
    # "low" decodes into the blocks "high" (better, admitted later, chunked 3 tokens a step)
    # still needs: by priority, "high" preempts the decode its step had scheduled; by arrival,
    # the newer "high" is the one preempted.
    eng = FakeEngine(budget=4, max_num_seqs=2, num_blocks=6, block_size=4, max_model_len=24, policy=policy,
                     max_num_partial_prefills=1)
    low = _add(eng, "low", 4, 16, 5, 0.0)
    eng.step()
    eng.step()  # "low" decodes: its second block
    high = _add(eng, "high", 16, 2, 0, 1.0)
    while not (low.num_preemptions or high.num_preemptions):
        out = eng.step()
    if policy == "priority":
        assert low.num_preemptions == 1 and "low" in out.preempted_request_ids
        assert [s.request_id for s in out.scheduled] == ["high"]  # the decode left the step
        assert out.num_decodes == 0
    else:
        assert high.num_preemptions == 1 and low.num_preemptions == 0
    eng.run()
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in eng.seqs.values())
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


def test_random_loads_by_priority_keep_the_order_and_the_kv_right(monkeypatch):
    """Seeded random loads in small caches (prefix caching on, aborts, arrivals over time): after
    every step the queues are in priority order, the blocks partition and every chunk reads its
    own tokens' KV (a block named with a token its step did not compute would be found by an
    equal sequence); all finish. The loads are tight enough that prompts take blocks from decodes
    already scheduled in their step, which the test counts."""
    unscheduled = []
    monkeypatch.setattr(Scheduler, "_unschedule_decode", _counting(Scheduler._unschedule_decode, unscheduled))
    rng = random.Random(0)
    for _ in range(300):
        block_size = rng.choice([2, 4])
        max_model_len = rng.randint(12, 40)
        eng = FakeEngine(budget=rng.randint(3, 8), max_num_seqs=3, max_model_len=max_model_len,
                         num_blocks=-(-max_model_len // block_size) + rng.randint(0, 3), block_size=block_size,
                         policy="priority", enable_prefix_caching=True, max_num_partial_prefills=rng.randint(1, 2))
        sched = eng.sched
        # Few prompt lengths and two families: equal prompts are common, and since the fake
        # model samples the same tokens for each, so are equal sequences that meet in the cache.
        # Later arrivals tend to be better: they come while worse requests decode.
        arrivals = sorted(rng.randint(0, 12) for _ in range(rng.randint(2, 7)))
        requests = [(arrival, min(rng.choice([5, 9, 14]), max_model_len - 4), rng.randint(1, 16),
                     3 - arrival // 4 + rng.randint(0, 1), rng.choice([None, rng.randint(0, 60)]))
                    for arrival in arrivals]
        for step in range(3000):
            for i, (arrival, prompt_len, max_tokens, priority, abort_at) in enumerate(requests):
                rid = f"r{i}"
                if arrival == step:
                    seq = make_seq(rid, prompt_len, max_tokens, [i % 2 * 50 + t for t in range(prompt_len)])
                    seq.priority, seq.arrival_time = priority, float(arrival)
                    eng.seqs[rid] = seq
                    sched.add(seq)
                if abort_at == step and rid in eng.seqs and not eng.seqs[rid].is_finished:
                    sched.finish(eng.seqs[rid], SequenceStatus.FINISHED_ABORTED)
            if step > 12 and not sched.has_unfinished():
                break
            eng.step()
            for queue in (list(sched.waiting), sched.running):
                keys = [sched.policy.key(s) for s in queue]
                assert keys == sorted(keys)
            assert_block_partition(eng.bm)
            _assert_named_blocks_hold_kv(eng)
        else:
            raise AssertionError("livelock")
        assert all(s.is_finished for s in eng.seqs.values()) and eng.bm.num_free_blocks == eng.bm.num_blocks
    assert len(unscheduled) >= 10


def _assert_named_blocks_hold_kv(eng: FakeEngine) -> None:
    """Every slot of a named block holds the KV of a position, the block's positions in order."""
    bs, cache = eng.bm.block_size, eng.bm.prefix_cache
    for block in range(eng.bm.num_blocks):
        if cache.hash_of(block) is not None:
            held = [eng.kv.get(block * bs + i) for i in range(bs)]
            assert None not in held, f"block {block} is named, but a slot was never written"
            first = held[0][0]
            assert [position for position, _ in held] == list(range(first, first + bs)), held


def _counting(method, calls):
    def wrapper(self, *args):
        calls.append(args[0].request_id)
        return method(self, *args)
    return wrapper


# ---------------------------------------------------------------- the engine, LLM and the server

PROMPTS = ["The capital of France is", "Once upon a time", "Bananas are", "In 1969 the first"]


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    def make(policy):
        return LLM(tiny_checkpoints["llama"], dtype="float32", max_model_len=256, block_size=16,
                   max_num_batched_tokens=32, max_num_seqs=1, enforce_eager=True, scheduling_policy=policy,
                   kv_cache_memory_bytes=8 * 2**20)
    return {policy: make(policy) for policy in ("fcfs", "priority")}


def test_priority_changes_the_order_not_the_tokens(engines):
    params = SamplingParams(temperature=0, max_tokens=6)
    fcfs = engines["fcfs"].generate(PROMPTS, params, use_tqdm=False)
    priorities = [3, 1, 2, 0]
    by_priority = engines["priority"].generate(PROMPTS, params, use_tqdm=False, priority=priorities)
    assert [o.outputs[0].token_ids for o in by_priority] == [o.outputs[0].token_ids for o in fcfs]
    # One sequence at a time: each request's first token comes after the better ones' last.
    first_token = [o.metrics.first_token_time for o in by_priority]
    order = sorted(range(len(PROMPTS)), key=first_token.__getitem__)
    assert order == sorted(range(len(PROMPTS)), key=priorities.__getitem__)


def test_a_priority_the_policy_cannot_serve_is_refused(engines):
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        engines["fcfs"].generate(PROMPTS[:1], params, priority=[1])
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        engines["priority"].generate(PROMPTS[:1], params, priority=[1, 2])
    with pytest.raises(ValueError, match="priority must be an integer"):
        engines["priority"].llm_engine.add_request("x", PROMPTS[0], params, priority=0.5)
    assert not engines["priority"].llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, policy="sjf")


def test_the_server_refuses_a_priority_under_fcfs(tiny_checkpoints):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(
        model=tiny_checkpoints["llama"], dtype="float32", max_model_len=256, block_size=16,
        enforce_eager=True, kv_cache_memory_bytes=8 * 2**20))
    completions = OpenAIServingCompletion(engine, ["tiny"])
    with pytest.raises(OpenAIServingError) as refused:
        asyncio.run(completions.create_completion(CompletionRequest(prompt="hi", max_tokens=2, priority=2)))
    assert refused.value.param == "priority" and "scheduling_policy" in str(refused.value)
