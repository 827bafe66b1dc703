"""The chunked-prefill scheduler, driven by a fake model step (no torch model, no runner).

`FakeEngine.step()` mimics `LLMEngine.step()`: schedule, then every chunk with `sample=True`
gets one new token through `Scheduler.update_from_output`, which finishes a request
(FINISHED_LENGTH) at `max_tokens` or `max_model_len`.
It also keeps a fake KV cache (the token id written to each slot), and checks that every chunk
finds its earlier tokens in the slots its block table names, written by an earlier step: what
attention would read, shared blocks and the prefix cache included.
"""

from collections import Counter
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm.config import SchedulerConfig
from vllm.core.block_manager import BlockManager, kv_slots
from vllm.core.scheduler import Scheduler
from vllm.core.scheduler_output import SchedulerOutput
from vllm.sampling_params import SamplingParams
from vllm.sequence import Sequence, SequenceStatus

# ---------------------------------------------------------------- helpers


def make_seq(request_id: str, prompt_len: int, max_tokens: int = 4,
             prompt: list[int] | None = None) -> Sequence:
    base = 1000 * (1 + sum(map(ord, request_id)))  # distinct token ids per request
    return Sequence(request_id=request_id, prompt=None,
                    prompt_token_ids=prompt or [base + i for i in range(prompt_len)],
                    sampling_params=SamplingParams(max_tokens=max_tokens), arrival_time=0.0)


def all_tokens(seq: Sequence) -> list[int]:
    return seq.prompt_token_ids + seq.output_token_ids


def calls(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.request_id, s.num_tokens, s.start_position) for s in out.scheduled]


class FakeEngine:
    """A Scheduler plus a fake KV cache, stepped as LLMEngine steps it."""

    def __init__(self, *, budget: int = 64, max_num_seqs: int = 8, max_model_len: int = 256,
                 num_blocks: int = 64, block_size: int = 16, enable_prefix_caching: bool = False,
                 **scheduler_kwargs) -> None:
        config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                 max_model_len=max_model_len, **scheduler_kwargs)
        self.bm = BlockManager(num_blocks, block_size, enable_caching=enable_prefix_caching)
        self.sched = Scheduler(config, self.bm)
        self.seqs: dict[str, Sequence] = {}
        self.outputs: list[SchedulerOutput] = []
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, token id) whose KV it holds

    def add(self, request_id: str, prompt_len: int, max_tokens: int = 4,
            prompt: list[int] | None = None) -> Sequence:
        seq = make_seq(request_id, prompt_len, max_tokens, prompt)
        self.seqs[request_id] = seq
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        bs = self.bm.block_size
        for s in out.scheduled:  # attention reads the context before the step writes anything
            tokens = all_tokens(self.seqs[s.request_id])
            context = [self.kv.get(slot) for slot in kv_slots(s.block_table, range(s.start_position), bs)]
            assert context == list(enumerate(tokens[:s.start_position])), f"{s.request_id} reads wrong KV"
        for s in out.scheduled:
            chunk = range(s.start_position, s.start_position + s.num_tokens)
            for p, slot in zip(chunk, kv_slots(s.block_table, chunk, bs)):
                self.kv[slot] = (p, s.token_ids[p - s.start_position])
        sampled = {}
        for s in out.scheduled:
            seq = self.seqs[s.request_id]
            assert s.token_ids == all_tokens(seq)[s.start_position:s.start_position + s.num_tokens]
            if s.sample:
                sampled[s.request_id] = 7 + len(seq.output_token_ids)
        self.sched.update_from_output(out, sampled, lambda seq, status: status)
        self.outputs.append(out)
        return out

    def run(self, max_steps: int = 1000) -> list[SchedulerOutput]:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return self.outputs
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps (livelock?)")


def assert_caps(out: SchedulerOutput, config: SchedulerConfig) -> None:
    ids = [s.request_id for s in out.scheduled]
    assert out.num_batched_tokens <= config.max_num_batched_tokens
    assert len(out.scheduled) <= config.max_num_seqs
    assert len(ids) == len(set(ids)), f"a request appears twice in one step: {ids}"


def assert_block_partition(bm: BlockManager) -> None:
    """A block is free exactly when no table holds it; its count is the tables that do."""
    holders = Counter(b for table in bm._tables.values() for b in table)
    free = bm.free_blocks()
    assert sorted(set(holders) | set(free)) == list(range(bm.num_blocks)), "blocks lost"
    assert not set(holders) & set(free) and len(free) == len(set(free)) == bm.num_free_blocks
    assert all(bm.ref_count(b) == holders[b] for b in range(bm.num_blocks))
    cache = bm.prefix_cache
    if cache is not None:
        # Names and blocks are one to one; evictable blocks are named, the others are not.
        named = {b: cache.hash_of(b) for b in range(bm.num_blocks) if cache.hash_of(b) is not None}
        assert all(cache.lookup(h) == b for b, h in named.items())
        assert set(cache.evictable_blocks()) <= set(named) and not set(bm._free) & set(named)
        # A block shared by several tables is named (only the cache and forks share blocks).
        assert all(b in named for b, n in holders.items() if n > 1)


# ---------------------------------------------------------------- 1. budget and decodes first


def test_caps_hold_and_every_running_decode_is_scheduled():
    eng = FakeEngine(budget=32, max_num_seqs=4, num_blocks=256, block_size=8)
    for i, (n, m) in enumerate([(50, 6), (3, 9), (70, 3), (20, 12), (9, 5), (33, 7), (1, 4)]):
        eng.add(f"r{i}", n, m)
    while eng.sched.has_unfinished():
        decodes = [s.request_id for s in eng.sched.running if not s.is_prefill]
        out = eng.step()
        assert_caps(out, eng.sched.config)
        assert len(eng.sched.running) <= 4
        # Every running decode is in the step, listed first, one token each.
        assert [s.request_id for s in out.scheduled[:out.num_decodes]] == decodes
        assert all(s.num_tokens == 1 for s in out.scheduled[:out.num_decodes])
        assert not out.preempted_request_ids
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in eng.seqs.values())
    assert [len(s.output_token_ids) for s in eng.seqs.values()] == [6, 9, 3, 12, 5, 7, 4]
    assert eng.bm.num_free_blocks == 256


def test_leftover_budget_is_filled_by_prefill_chunk():
    """A decode-heavy step still uses the whole budget for the waiting prompt."""
    eng = FakeEngine(budget=16, max_num_seqs=4, max_num_partial_prefills=2)
    eng.add("a", 4, max_tokens=10)
    eng.add("b", 4, max_tokens=10)
    assert calls(eng.step()) == [("a", 4, 0), ("b", 4, 0)]
    eng.add("c", 40)
    assert calls(eng.step()) == [("a", 1, 4), ("b", 1, 4), ("c", 14, 0)]
    assert calls(eng.step()) == [("a", 1, 5), ("b", 1, 5), ("c", 14, 14)]


# ---------------------------------------------------------------- 2. the exact example


@pytest.mark.parametrize("max_partial", [1, 2])
def test_two_60_token_prompts_budget_64(max_partial):
    eng = FakeEngine(budget=64, block_size=16, num_blocks=64, max_num_partial_prefills=max_partial)
    eng.add("A", 60)
    eng.add("B", 60)
    step1 = eng.step()
    step2 = eng.step()
    assert calls(step1) == [("A", 60, 0), ("B", 4, 0)]
    assert calls(step2) == [("A", 1, 60), ("B", 56, 4)]
    assert (step1.num_decodes, step2.num_decodes) == (0, 1)


# ---------------------------------------------------------------- 3. sample flags


def test_only_the_final_chunk_samples():
    eng = FakeEngine(budget=16)
    seq = eng.add("a", 40, max_tokens=2)
    steps = [eng.step() for _ in range(4)]
    flat = [(s.request_id, s.num_tokens, s.start_position, s.sample)
            for out in steps for s in out.scheduled]
    assert flat == [("a", 16, 0, False), ("a", 16, 16, False), ("a", 8, 32, True),
                    ("a", 1, 40, True)]
    assert seq.output_token_ids == [7, 8]
    assert seq.status is SequenceStatus.FINISHED_LENGTH
    assert not eng.sched.has_unfinished()
    assert eng.step().is_empty


def test_block_table_covers_the_chunk():
    eng = FakeEngine(budget=20, block_size=8)
    eng.add("a", 50, max_tokens=3)
    for out in eng.run():
        for s in out.scheduled:
            assert len(s.block_table) == -(-(s.start_position + s.num_tokens) // 8)


# ---------------------------------------------------------------- 4. threshold and partial prefills


def test_long_prefill_token_threshold_caps_chunks():
    eng = FakeEngine(budget=64, long_prefill_token_threshold=16)
    eng.add("a", 40, max_tokens=1)
    assert [calls(eng.step()) for _ in range(3)] == [[("a", 16, 0)], [("a", 16, 16)],
                                                       [("a", 8, 32)]]
    assert not eng.sched.has_unfinished()


def test_one_long_partial_prefill_at_a_time_by_default():
    eng = FakeEngine(budget=64, long_prefill_token_threshold=16)
    eng.add("a", 40, max_tokens=1)
    eng.add("b", 40, max_tokens=1)
    assert calls(eng.step()) == [("a", 16, 0)]
    assert calls(eng.step()) == [("a", 16, 16)]


def test_two_partial_prefills_run_concurrently():
    eng = FakeEngine(budget=64, long_prefill_token_threshold=16, max_num_partial_prefills=2,
                     max_long_partial_prefills=2)
    eng.add("a", 40, max_tokens=1)
    eng.add("b", 40, max_tokens=1)
    eng.add("c", 40, max_tokens=1)
    assert calls(eng.step()) == [("a", 16, 0), ("b", 16, 0)]
    assert calls(eng.step()) == [("a", 16, 16), ("b", 16, 16)]
    assert [s.request_id for s in eng.sched.waiting] == ["c"]
    eng.run()
    assert all(s.is_finished for s in eng.seqs.values())


# ---------------------------------------------------------------- 5. preemption


def test_preemption_frees_newest_and_recomputes_from_zero():
    # 4 blocks of 4 tokens: two requests fit until each needs a third block.
    eng = FakeEngine(budget=64, max_model_len=16, num_blocks=4, block_size=4,
                     max_num_partial_prefills=2)
    a = eng.add("a", 4, max_tokens=8)
    b = eng.add("b", 4, max_tokens=8)
    assert calls(eng.step()) == [("a", 4, 0), ("b", 4, 0)]
    for pos in range(4, 8):
        assert calls(eng.step()) == [("a", 1, pos), ("b", 1, pos)]
    assert eng.bm.num_free_blocks == 0
    # a needs a 3rd block for position 8: b (admitted last) is preempted.
    out = eng.step()
    assert calls(out) == [("a", 1, 8)]
    assert out.preempted_request_ids == ["b"]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and eng.sched.num_preemptions == 1
    assert eng.bm.block_table("b") == [] and len(eng.bm.block_table("a")) == 3
    assert list(eng.sched.waiting) == [b] and eng.sched.running == [a]
    generated = list(b.output_token_ids)
    assert len(generated) == 5
    # b waits until a finishes, then recomputes prompt + its generated tokens from position 0.
    while not a.is_finished:
        assert "b" not in [s.request_id for s in eng.step().scheduled]
    out = eng.step()
    assert calls(out) == [("b", 9, 0)]
    assert out.scheduled[0].token_ids == b.prompt_token_ids + generated
    assert out.scheduled[0].sample
    eng.run()
    assert b.status is SequenceStatus.FINISHED_LENGTH and len(b.output_token_ids) == 8
    assert eng.bm.num_free_blocks == 4


def test_preempted_request_goes_to_the_head_of_the_waiting_queue():
    eng = FakeEngine(budget=64, max_model_len=16, num_blocks=4, block_size=4,
                     max_num_partial_prefills=2, max_num_seqs=2)
    eng.add("a", 4, max_tokens=8)
    eng.add("b", 4, max_tokens=8)
    eng.add("c", 4, max_tokens=1)  # waits: max_num_seqs=2
    while not eng.outputs or not eng.outputs[-1].preempted_request_ids:
        eng.step()
    assert eng.outputs[-1].preempted_request_ids == ["b"]
    assert [s.request_id for s in eng.sched.waiting] == ["b", "c"]
    eng.run()
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in eng.seqs.values())


def test_a_decode_preempts_a_newer_partial_prefill():
    # 2 blocks of 8 tokens: a holds one; b's whole prompt fits in the other, so b is admitted,
    # and its first chunk takes it.
    eng = FakeEngine(budget=4, max_num_seqs=2, max_model_len=16, num_blocks=2, block_size=8,
                     max_num_partial_prefills=2)
    a = eng.add("a", 7, max_tokens=5)
    assert calls(eng.step()) == [("a", 4, 0)]
    assert calls(eng.step()) == [("a", 3, 4)]
    b = eng.add("b", 8, max_tokens=1)
    assert calls(eng.step()) == [("a", 1, 7), ("b", 3, 0)]
    out = eng.step()  # a's position 8 needs a second block: b loses its chunk
    assert calls(out) == [("a", 1, 8)] and out.preempted_request_ids == ["b"]
    assert b.num_computed_tokens == 0 and eng.bm.block_table("b") == []
    eng.run()
    later = [c for o in eng.outputs[4:] for c in calls(o) if c[0] == "b"]
    assert later == [("b", 4, 0), ("b", 4, 4)]  # a is done: b gets the whole budget
    assert a.status is b.status is SequenceStatus.FINISHED_LENGTH


def test_a_prefill_waits_rather_than_preempt_a_decode_scheduled_this_step():
    eng = FakeEngine(budget=64, max_model_len=16, num_blocks=4, block_size=4,
                     max_num_partial_prefills=2, long_prefill_token_threshold=4)
    a = eng.add("a", 16, max_tokens=1)
    b = eng.add("b", 1, max_tokens=4)
    assert [calls(eng.step()) for _ in range(5)] == [
        [("a", 4, 0), ("b", 1, 0)],
        [("b", 1, 1), ("a", 4, 4)],
        [("b", 1, 2), ("a", 4, 8)],
        [("b", 1, 3)],  # a needs a 4th block; b (newer) already runs in this step
        [("a", 4, 12)],  # b finished and freed its block
    ]
    assert eng.sched.num_preemptions == 0
    assert a.is_finished and b.is_finished


# ---------------------------------------------------------------- 6. requests that can never run


def test_unschedulable_requests_are_ignored_and_others_complete():
    eng = FakeEngine(budget=32, max_model_len=64, num_blocks=3, block_size=16)
    ok1 = eng.add("ok1", 10, max_tokens=3)
    too_long = eng.add("too_long", 65)
    too_big = eng.add("too_big", 49)  # 4 blocks, the cache has 3
    ok2 = eng.add("ok2", 30, max_tokens=2)
    for seq, word in ((too_long, "max_model_len"), (too_big, "blocks")):
        assert seq.status is SequenceStatus.FINISHED_IGNORED
        assert seq.error and word in seq.error
        assert seq.status.finish_reason == "length"
    assert [s.request_id for s in eng.sched.waiting] == ["ok1", "ok2"]
    eng.run()
    assert ok1.status is ok2.status is SequenceStatus.FINISHED_LENGTH
    assert ok1.error is None and ok2.error is None
    scheduled = {s.request_id for out in eng.outputs for s in out.scheduled}
    assert scheduled == {"ok1", "ok2"}


# ---------------------------------------------------------------- 7. without chunked prefill


def test_classic_steps_are_whole_prefills_or_decodes_only():
    eng = FakeEngine(budget=64, max_model_len=64, max_num_seqs=4, enable_chunked_prefill=False)
    for i, n in enumerate([30, 30, 10, 50, 5]):
        eng.add(f"r{i}", n, max_tokens=3)
    eng.run()
    out = eng.outputs
    assert [calls(o) for o in out] == [
        [("r0", 30, 0), ("r1", 30, 0)],              # r2 would exceed the budget of 64
        [("r2", 10, 0), ("r3", 50, 0)],              # now max_num_seqs=4 are running
        [("r0", 1, 30), ("r1", 1, 30), ("r2", 1, 10), ("r3", 1, 50)],
        [("r0", 1, 31), ("r1", 1, 31), ("r2", 1, 11), ("r3", 1, 51)],
        [("r4", 5, 0)],
        [("r4", 1, 5)],
        [("r4", 1, 6)],
    ]
    for o in out:
        assert_caps(o, eng.sched.config)
        if o.num_decodes:
            assert o.num_decodes == len(o.scheduled)
            assert all(s.num_tokens == 1 for s in o.scheduled)
        else:
            assert all(s.start_position == 0 and s.sample for s in o.scheduled)
            assert all(s.num_tokens == eng.seqs[s.request_id].num_prompt_tokens
                       for s in o.scheduled)
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in eng.seqs.values())


def test_classic_requires_budget_at_least_max_model_len():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=4, max_model_len=128,
                        enable_chunked_prefill=False)
    SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=4, max_model_len=128,
                    enable_chunked_prefill=False)
    SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=4, max_model_len=128)  # chunked: ok


@pytest.mark.parametrize("field,value", [
    ("max_num_batched_tokens", 0),
    ("max_num_seqs", 0),
    ("max_model_len", -1),
    ("max_num_partial_prefills", 0),
    ("long_prefill_token_threshold", -1),
    ("max_num_seqs", 65),  # more than max_num_batched_tokens
])
def test_scheduler_config_errors_name_the_field(field, value):
    kwargs = dict(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


# ---------------------------------------------------------------- aborts and finished ids


def test_abort_frees_blocks_and_is_reported_next_step():
    eng = FakeEngine(budget=16, block_size=4, num_blocks=16)
    a = eng.add("a", 30, max_tokens=5)
    w = eng.add("w", 4)
    eng.step()
    assert eng.bm.num_free_blocks == 12
    eng.sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    eng.sched.finish(w, SequenceStatus.FINISHED_ABORTED)  # still waiting
    assert eng.bm.num_free_blocks == 16
    out = eng.step()
    assert out.is_empty and out.finished_request_ids == ["a", "w"]
    assert eng.step().finished_request_ids == []
    assert not eng.sched.has_unfinished()


# ---------------------------------------------------------------- 8. random workloads


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_model_len = draw(st.integers(4, 64))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 6))
    if chunked:
        budget = draw(st.integers(max_num_seqs, 80))
    else:
        budget = draw(st.integers(max(max_model_len, max_num_seqs), 130))
    # As the engine guarantees (determine_num_blocks), one request always fits in the cache.
    min_blocks = -(-max_model_len // block_size)
    num_blocks = draw(st.integers(min_blocks, min_blocks + 12))
    config = dict(budget=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                  num_blocks=num_blocks, block_size=block_size, enable_chunked_prefill=chunked,
                  max_num_partial_prefills=draw(st.integers(1, 3)),
                  long_prefill_token_threshold=draw(st.sampled_from([0, 0, 1, 5, 16])))
    config["enable_prefix_caching"] = draw(st.booleans())
    config["policy"] = draw(st.sampled_from(["fcfs", "priority"]))
    requests = draw(st.lists(st.tuples(
        st.integers(1, max_model_len + 4),               # prompt length (some too long)
        st.integers(1, 20),                              # max_tokens
        st.one_of(st.none(), st.integers(0, 40)),        # abort before this step, or never
        st.integers(0, 10),                              # arrival step
        st.integers(0, 3),                               # prompts of one family begin alike
        st.integers(0, 2),                               # priority (under the priority policy)
    ), min_size=1, max_size=10))
    return config, requests


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_and_keep_invariants(workload):
    """Random workloads, with and without prefix caching (prompts of a family share their
    beginnings, and equal prompts equal outputs, so blocks of outputs are found too; a small
    cache preempts and evicts): the caps, decodes first, the block partition and the names of
    cached blocks hold after every step, and every chunk reads its own tokens' KV. Under the
    priority policy, the waiting queue and the running list stay in (priority, arrival) order."""
    config, requests = workload
    eng = FakeEngine(**config)
    sched, bm = eng.sched, eng.bm
    pending = sorted(enumerate(requests), key=lambda r: r[1][3])
    for step in range(2000):
        while pending and pending[0][1][3] <= step:
            i, (n, m, _, arrival, family, priority) = pending.pop(0)
            # Family 3 repeats 4 tokens: its blocks hold equal tokens at different positions.
            prompt = [100 * family + (t % 4 if family == 3 else t) for t in range(n)]
            seq = make_seq(f"r{i}", n, m, prompt)
            if config["policy"] == "priority":
                seq.priority, seq.arrival_time = priority, float(arrival)
            eng.seqs[seq.request_id] = seq
            sched.add(seq)
        for i, (_, _, abort_at, _, _, _) in enumerate(requests):
            seq = eng.seqs.get(f"r{i}")
            if seq is not None and abort_at == step and not seq.is_finished:
                sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
        if not pending and not sched.has_unfinished():
            break
        decodes = [s.request_id for s in sched.running if not s.is_prefill]
        out = eng.step()
        ids = [s.request_id for s in out.scheduled]
        assert_caps(out, sched.config)
        assert not set(ids) & set(out.preempted_request_ids)
        # Decodes first; a running decode is skipped only when it was preempted or blocks ran out.
        assert all(s.num_tokens == 1 for s in out.scheduled[:out.num_decodes])
        if not out.preempted_request_ids and (out.num_decodes or sched.config.enable_chunked_prefill):
            assert ids[:out.num_decodes] == decodes
        if not sched.config.enable_chunked_prefill:
            assert out.num_decodes in (0, len(out.scheduled))
        assert_block_partition(bm)
        assert {r for r, t in bm._tables.items() if t} <= {s.request_id for s in sched.running}
        assert not {s.request_id for s in sched.running} & {s.request_id for s in sched.waiting}
        assert len(sched.running) <= sched.config.max_num_seqs
        if config["policy"] == "priority":
            for queue in (list(sched.waiting), sched.running):
                keys = [sched.policy.key(s) for s in queue]
                assert keys == sorted(keys)
    else:
        raise AssertionError("workload did not finish in 2000 steps (livelock)")
    assert all(s.is_finished for s in eng.seqs.values())
    for seq in eng.seqs.values():
        if seq.status is SequenceStatus.FINISHED_IGNORED:
            assert seq.error
        elif seq.status is SequenceStatus.FINISHED_LENGTH:
            assert (len(seq.output_token_ids) == seq.sampling_params.max_tokens
                    or seq.num_tokens >= config["max_model_len"])
    assert bm.num_free_blocks == bm.num_blocks
    assert_block_partition(bm)
    assert sched.num_prefix_cache_hits <= sched.num_prefix_cache_queries
    if not config["enable_prefix_caching"]:
        assert sched.num_prefix_cache_queries == 0
