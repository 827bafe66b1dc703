"""Scheduler.undo: a step taken back leaves the scheduler as if it had never been scheduled,
so scheduling again hands out the same tokens."""

import dataclasses

import pytest

from tests.test_scheduler import FakeEngine, calls
from vllm.sequence import SequenceStatus


@pytest.mark.parametrize("chunked", [True, False])
def test_a_step_taken_back_is_scheduled_again_the_same(chunked):
    eng = FakeEngine(budget=32 if chunked else 64, num_blocks=20, block_size=8, max_model_len=64,
                     enable_chunked_prefill=chunked)
    eng.add("a", 20, max_tokens=6)
    eng.step()  # a: its prompt (chunked: its first chunk)
    eng.add("b", 40, max_tokens=2)
    eng.add("c", 5, max_tokens=2)
    for _ in range(3):
        waiting = [s.request_id for s in eng.sched.waiting]
        running = [s.request_id for s in eng.sched.running]
        computed = {rid: s.num_computed_tokens for rid, s in eng.seqs.items()}
        free = eng.bm.num_free_blocks
        step = eng.sched.schedule()
        assert step.scheduled
        eng.sched.undo(step)
        assert [s.request_id for s in eng.sched.waiting] == waiting
        assert [s.request_id for s in eng.sched.running] == running
        assert {rid: s.num_computed_tokens for rid, s in eng.seqs.items()} == computed
        # Admitted requests give their blocks back; running ones may keep what they grew into.
        assert eng.bm.num_free_blocks >= free - len(running)
        assert all(s.status is SequenceStatus.WAITING for s in eng.sched.waiting)
        again = eng.step()
        assert calls(again) == calls(step)
    eng.run()
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


def test_undo_keeps_block_copies_finished_ids_and_prompt_logprob_positions():
    eng = FakeEngine(budget=16, num_blocks=20, block_size=8)
    a = eng.add("a", 30, max_tokens=2)
    a.sampling_params = dataclasses.replace(a.sampling_params, prompt_logprobs=1)
    eng.add("gone", 4, max_tokens=1)
    eng.sched.finish(eng.seqs["gone"], SequenceStatus.FINISHED_ABORTED)
    eng.sched._blocks_to_copy.append((3, 4))  # as a fork since the last step leaves it
    step = eng.sched.schedule()
    assert step.finished_request_ids == ["gone"] and step.blocks_to_copy == [(3, 4)]
    assert a.num_prompt_logprob_positions == 16
    eng.sched.undo(step)
    assert a.num_prompt_logprob_positions == 0 and a.num_computed_tokens == 0
    again = eng.sched.schedule()
    assert again.finished_request_ids == ["gone"] and again.blocks_to_copy == [(3, 4)]
    assert again.scheduled[0].prompt_logprob_targets == step.scheduled[0].prompt_logprob_targets


def test_undo_of_another_step_than_the_last_is_refused():
    eng = FakeEngine()
    eng.add("a", 10)
    old = eng.step()
    eng.sched.schedule()
    with pytest.raises(AssertionError, match="last one scheduled"):
        eng.sched.undo(old)
