"""Short prompts beside long ones: `max_long_partial_prefills` and the long/short budget split
(Scheduler._schedule_prefills), on the fake engine of test_scheduler.

With max_model_len=256 and several partial prefills, a prompt is long above 10 tokens left
(4% of max_model_len, vLLM's rule).
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_scheduler import FakeEngine, calls


def _prefill_ids(out) -> list[str]:
    return [s.request_id for s in out.scheduled[out.num_decodes:]]


def test_the_threshold_is_derived_as_vllm_does():
    assert FakeEngine(max_model_len=256).sched.config.long_prompt_threshold == 10
    assert FakeEngine(max_model_len=256, long_prefill_token_threshold=50).sched.config.long_prompt_threshold == 50
    # One partial prefill: nobody is long, plain FCFS.
    assert FakeEngine(max_model_len=256, max_num_partial_prefills=1).sched.config.long_prompt_threshold == 0


def test_a_short_prompt_starts_beside_a_long_one_in_the_same_step():
    eng = FakeEngine(budget=64, num_blocks=64, block_size=16)
    eng.add("long", 200, max_tokens=2)
    assert calls(eng.step()) == [("long", 64, 0)]
    eng.add("short", 8, max_tokens=2)
    # The short prompt takes what it needs; the long one the rest of the budget.
    assert calls(eng.step()) == [("long", 56, 64), ("short", 8, 0)]
    assert eng.outputs[-1].scheduled[1].sample
    # FCFS SARATHI (one partial prefill) keeps it waiting until the long prompt is done.
    fcfs = FakeEngine(budget=64, num_blocks=64, block_size=16, max_num_partial_prefills=1)
    fcfs.add("long", 200, max_tokens=2)
    fcfs.step()
    fcfs.add("short", 8, max_tokens=2)
    assert calls(fcfs.step()) == [("long", 64, 64)]


def test_a_short_prompt_passes_a_long_one_waiting_for_the_long_slot():
    eng = FakeEngine(budget=64, num_blocks=64, block_size=16)
    eng.add("L1", 200, max_tokens=1)
    eng.step()
    eng.add("L2", 100, max_tokens=1)
    eng.add("s", 9, max_tokens=1)
    out = eng.step()
    assert calls(out) == [("L1", 55, 64), ("s", 9, 0)]
    assert [s.request_id for s in eng.sched.waiting] == ["L2"]


def test_long_prompts_share_the_budget_with_a_stream_of_short_ones_and_keep_their_order():
    """Two short prompts of 20 tokens arrive every step, more than the budget can take: the
    long prompts still get half of it each step, and start in arrival order."""
    budget = 64
    eng = FakeEngine(budget=budget, max_num_seqs=16, num_blocks=256, block_size=16, max_model_len=512)
    assert eng.sched.config.long_prompt_threshold == 20
    eng.add("L1", 300, max_tokens=1)
    eng.add("L2", 300, max_tokens=1)
    started: list[str] = []
    for step in range(600 // (budget // 2) + 1):
        eng.add(f"s{step}a", 20, max_tokens=1)
        eng.add(f"s{step}b", 20, max_tokens=1)
        before = {rid: eng.seqs[rid].num_computed_tokens for rid in ("L1", "L2")}
        out = eng.step()
        assert out.num_decodes == 0 and out.num_batched_tokens == budget
        long_tokens = sum(s.num_tokens for s in out.scheduled if s.request_id in ("L1", "L2"))
        remaining = 600 - sum(before.values())
        assert long_tokens >= min(budget // 2, remaining)
        assert out.num_batched_tokens - long_tokens > 0  # short prompts progress too
        started += [rid for rid in ("L1", "L2") if before[rid] == 0 and eng.seqs[rid].num_computed_tokens]
    assert eng.seqs["L1"].is_finished and eng.seqs["L2"].is_finished
    assert started == ["L1", "L2"]


def test_the_oldest_waiting_long_prompt_takes_the_long_slot_as_soon_as_it_frees():
    eng = FakeEngine(budget=64, max_num_seqs=16, num_blocks=256, block_size=16)
    for rid in ("L1", "L2", "L3"):
        eng.add(rid, 100, max_tokens=1)
    assert calls(eng.step()) == [("L1", 64, 0)]
    eng.add("s", 8, max_tokens=1)
    # L1's last 36 tokens free the long slot: L2 takes it in the same step, in the budget the
    # short prompt leaves; L3 waits for the next one.
    assert calls(eng.step()) == [("L1", 36, 64), ("L2", 20, 0), ("s", 8, 0)]
    assert [s.request_id for s in eng.sched.waiting] == ["L3"]


def test_running_decodes_still_come_first():
    eng = FakeEngine(budget=32, max_num_seqs=8, num_blocks=128, block_size=16)
    eng.add("d1", 4, max_tokens=50)
    eng.add("d2", 4, max_tokens=50)
    eng.step()
    eng.add("long", 150, max_tokens=1)
    for i in range(6):
        eng.add(f"s{i}", 6, max_tokens=1)
        out = eng.step()
        assert [s.request_id for s in out.scheduled[:out.num_decodes]] == ["d1", "d2"]
        assert "long" in _prefill_ids(out) and f"s{i}" in _prefill_ids(out)
        assert out.num_batched_tokens == 32


def test_taking_back_a_step_that_admitted_out_of_order_restores_the_queue():
    eng = FakeEngine(budget=64, num_blocks=64, block_size=16)
    eng.add("L1", 200, max_tokens=1)
    eng.step()
    for rid, n in (("L2", 100), ("s1", 9), ("L3", 80), ("s2", 5)):
        eng.add(rid, n, max_tokens=1)
    step = eng.sched.schedule()
    assert [s.request_id for s in eng.sched.waiting] == ["L2", "L3"]
    eng.sched.undo(step)
    assert [s.request_id for s in eng.sched.waiting] == ["L2", "s1", "L3", "s2"]
    assert calls(eng.step()) == calls(step)


def test_no_budget_is_set_aside_for_a_long_prompt_that_cannot_start():
    # One seat: the waiting long prompt b cannot start beside a, which is short once its first
    # token is computed. Half the budget of one token kept for b would stall a forever.
    eng = FakeEngine(budget=1, max_num_seqs=1, max_model_len=50, num_blocks=50, block_size=1)
    assert eng.sched.config.long_prompt_threshold == 2
    eng.add("a", 3, max_tokens=1)
    eng.add("b", 3, max_tokens=1)
    eng.run(max_steps=20)
    assert eng.seqs["a"].is_finished and eng.seqs["b"].is_finished


@st.composite
def mixed_workloads(draw):
    max_partial = draw(st.integers(2, 4))
    config = dict(budget=draw(st.integers(8, 96)), max_num_seqs=8, max_model_len=400, block_size=16,
                  num_blocks=draw(st.sampled_from([30, 400])), max_num_partial_prefills=max_partial,
                  max_long_partial_prefills=draw(st.integers(1, max_partial)),
                  long_prefill_token_threshold=draw(st.sampled_from([0, 0, 12, 40])),
                  enable_prefix_caching=draw(st.booleans()))
    requests = draw(st.lists(st.tuples(st.sampled_from([3, 9, 15, 60, 150, 300]),  # prompt length
                                       st.integers(1, 6),                            # max_tokens
                                       st.integers(0, 12)),                          # arrival step
                             min_size=1, max_size=12))
    return config, requests


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixed_workloads())
def test_random_mixes_of_long_and_short_prompts(workload):
    """Every step a waiting prompt starts when nothing runs; the slot caps hold; without
    preemptions long prompts start in arrival order; everything finishes."""
    config, requests = workload
    eng = FakeEngine(**config)
    sched = eng.sched
    pending = sorted(enumerate(requests), key=lambda r: r[1][2])
    long_arrivals: list[str] = []
    long_starts: list[str] = []
    for step in range(3000):
        while pending and pending[0][1][2] <= step:
            i, (n, m, _) = pending.pop(0)
            seq = eng.add(f"r{i}", n, m)
            if sched._is_long(n) and not seq.is_finished:
                long_arrivals.append(seq.request_id)
        if not pending and not sched.has_unfinished():
            break
        idle = not sched.running and bool(sched.waiting)
        waiting_before = {s.request_id for s in sched.waiting}
        out = eng.step()
        if idle:
            assert out.num_prefill_tokens > 0, "a waiting prompt made no progress with nothing running"
        long_starts += [s.request_id for s in out.scheduled
                        if s.request_id in waiting_before and s.request_id in long_arrivals
                        and s.request_id not in long_starts]
        partial = [s for s in sched.running if s.is_prefill]
        assert len(partial) <= sched.config.max_num_partial_prefills
        assert sum(sched._is_long(s.num_uncomputed_tokens) for s in partial) <= sched.config.max_long_partial_prefills
    else:
        raise AssertionError("workload did not finish in 3000 steps")
    assert all(s.is_finished for s in eng.seqs.values())
    if sched.num_preemptions == 0:
        assert long_starts == long_arrivals


def test_every_short_prompt_gets_its_first_token_in_its_first_step_beside_long_ones():
    """The issue's queue (L, s, L, s, s, s, s, s), scaled to the fake engine: the short prompts
    fit in half the budget, so all of them sample in the first step."""
    eng = FakeEngine(budget=64, max_num_seqs=16, num_blocks=256, block_size=16, max_model_len=1024)
    lengths = [400, 5, 300, 5, 5, 5, 5, 5]
    for i, n in enumerate(lengths):
        eng.add(f"r{i}", n, max_tokens=2)
    first = eng.step()
    assert {s.request_id for s in first.scheduled if s.sample} == {f"r{i}" for i, n in enumerate(lengths) if n == 5}
    assert calls(first)[0] == ("r0", 64 - 30, 0)
    eng.run()
