"""Scheduler.update_from_output: the scheduler takes the sampled tokens in, forks, and finishes
the requests that stop (no torch, no model)."""

import pytest

from tests.test_scheduler import FakeEngine, make_seq
from vllm.sampling_params import SamplingParams
from vllm.sequence import SequenceStatus

EOS = 2


def keep(seq, status):
    return status


def one_sample_step(eng, params: SamplingParams, prompt_len: int = 5):
    """Adds request "a" with `params` and schedules its whole prompt."""
    seq = make_seq("a", prompt_len)
    seq.sampling_params, seq.eos_token_id = params, EOS
    eng.seqs["a"] = seq
    eng.sched.add(seq)
    return seq, eng.sched.schedule()


def test_forks_start_from_the_prompt_and_take_their_own_tokens():
    eng = FakeEngine(block_size=4)
    parent = eng.add("0_r", 10, max_tokens=3)
    children = [make_seq(f"{i}_r", 0, 3, prompt=parent.prompt_token_ids) for i in (1, 2)]
    parent.pending_forks = children
    step = eng.sched.schedule()
    assert [f for f, _ in step.scheduled[0].forks] == ["1_r", "2_r"]
    updated = eng.sched.update_from_output(step, {"0_r": 5, "1_r": 6, "2_r": 7}, keep)
    assert updated == [parent, *children]
    assert [s.output_token_ids for s in updated] == [[5], [6], [7]]
    assert all(s.status is SequenceStatus.RUNNING and s.num_computed_tokens == 10 for s in children)
    # The two full prompt blocks are shared; each fork copies the partial third one.
    table = eng.bm.block_table("0_r")
    assert [eng.bm.block_table(c.request_id)[:2] for c in children] == [table[:2]] * 2
    assert [src for src, _ in eng.sched.schedule().blocks_to_copy] == [table[2]] * 2


@pytest.mark.parametrize("params, token, status, reason", [
    (SamplingParams(), EOS, SequenceStatus.FINISHED_STOPPED, None),
    (SamplingParams(ignore_eos=True), EOS, None, None),
    (SamplingParams(min_tokens=2), EOS, None, None),
    (SamplingParams(stop_token_ids=[9]), 9, SequenceStatus.FINISHED_STOPPED, 9),
    (SamplingParams(max_tokens=1), 3, SequenceStatus.FINISHED_LENGTH, None),
    (SamplingParams(), 3, None, None),
])
def test_tokens_and_lengths_stop_requests(params, token, status, reason):
    eng = FakeEngine()
    seq, step = one_sample_step(eng, params)
    seen = []
    eng.sched.update_from_output(step, {"a": token}, lambda s, st: seen.append(st) or st)
    assert seen == [status]  # the stop-string check sees the scheduler's decision
    assert seq.status is (status or SequenceStatus.RUNNING) and seq.stop_reason == reason
    assert (seq in eng.sched.running) == (status is None)
    assert eng.bm.num_free_blocks == eng.bm.num_blocks - (status is None)


def test_max_model_len_stops_a_request():
    eng = FakeEngine(max_model_len=6)
    seq, step = one_sample_step(eng, SamplingParams(max_tokens=10))
    eng.sched.update_from_output(step, {"a": 3}, keep)
    assert seq.status is SequenceStatus.FINISHED_LENGTH


@pytest.mark.parametrize("max_tokens", [1, 10])
def test_the_stop_string_check_has_the_last_word(max_tokens):
    eng = FakeEngine()
    seq, step = one_sample_step(eng, SamplingParams(max_tokens=max_tokens))
    eng.sched.update_from_output(step, {"a": 3}, lambda s, st: SequenceStatus.FINISHED_STOPPED)
    assert seq.status is SequenceStatus.FINISHED_STOPPED and not eng.sched.has_unfinished()
    assert eng.sched.schedule().finished_request_ids == ["a"]


def test_update_of_another_step_than_the_last_is_refused():
    eng = FakeEngine()
    eng.add("a", 5)
    first = eng.sched.schedule()
    eng.sched.update_from_output(first, {"a": 3}, keep)
    eng.sched.schedule()
    with pytest.raises(AssertionError, match="last one"):
        eng.sched.update_from_output(first, {"a": 3}, keep)
