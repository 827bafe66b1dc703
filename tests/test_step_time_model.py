"""The step-time model and the step budget it gives under `max_step_latency_ms`: the fit, the
choice of a chunk, and the scheduler sizing its steps with a fake model (no torch model)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_scheduler import FakeEngine
from vllm.core.step_time_model import (MIN_PREFILL_CHUNK, MIN_TAIL_SAMPLES, MISS_ALLOWANCE,
                                       MISS_WINDOW_STEPS, StepShape, StepTimeModel, attended_pairs,
                                       latency_budget)
from vllm.worker.bucketing import BucketConfig, generate_buckets


BUCKETS = generate_buckets(BucketConfig(min=16, step=128, max=512))  # 16, 32, ..., 512


def one_chunk(context: int):
    """Prefill priced as one chunk after `context` cached tokens."""
    return lambda num_tokens: [(num_tokens, context)]


class FakeStepTimes:
    """Exactly linear step times, no fitting: 1 ms + 20 us a token + 5 ns a prefill query-key
    pair + 40 ns a key a decode reads."""

    is_fitted = True
    coefficients = (1e-3, 2e-5, 5e-9, 4e-8)
    tail_seconds = 0.0

    def __init__(self, may_miss: bool = True) -> None:
        self._may_miss = may_miss  # whether the target's percentile has room for more misses

    def predict(self, shape: StepShape) -> float:
        return float(np.dot(self.coefficients, shape.features()))

    def may_miss(self, num_decodes: int) -> bool:
        return self._may_miss


def test_attended_pairs_counts_the_causal_triangle_after_the_context():
    assert attended_pairs([(1, 0)]) == 1
    assert attended_pairs([(3, 0)]) == 6           # 1 + 2 + 3
    assert attended_pairs([(2, 10), (1, 4)]) == 11 + 12 + 5


def test_the_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    truth = np.array([2e-3, 3e-5, 4e-9, 3e-8])
    warmup = [(StepShape(t), truth[0] + truth[1] * t) for t in (16, 32, 64, 128, 256, 512)]
    model = StepTimeModel()
    model.fit_warmup(warmup)
    assert model.coefficients[2:] == (0, 0)  # padding-only runs attend nothing
    np.testing.assert_allclose(model.coefficients[:2], truth[:2], rtol=1e-6)
    for _ in range(200):
        shape = StepShape(int(rng.integers(1, 512)), int(rng.integers(0, 2_000_000)),
                          int(rng.integers(0, 50_000)))
        seconds = float(np.dot(truth, shape.features())) * (1 + 0.01 * rng.standard_normal())
        model.observe(shape, seconds)
    np.testing.assert_allclose(model.coefficients, truth, rtol=0.05)


def test_the_fit_never_goes_negative():
    # Times that fall with the tokens (noise, say): the slope is clamped at 0, not fitted below.
    model = StepTimeModel()
    model.fit_warmup([(StepShape(t), 0.01 - 1e-6 * t) for t in (16, 64, 256)])
    assert all(c >= 0 for c in model.coefficients)
    assert model.predict(StepShape(512, 10**6, 10**4)) >= model.predict(StepShape(16)) > 0


def test_the_fit_weighs_small_steps_as_much_as_large_ones():
    # A fixed cost and a slope that grows a little at large sizes: fitted on absolute errors the
    # largest buckets would set the line and miss a small step's time by half.
    sizes = [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048]

    def truth(n: int) -> float:
        return 0.020 + 5e-4 * n + 1.5e-7 * n * n

    model = StepTimeModel()
    model.fit_warmup([(StepShape(n), truth(n)) for n in sizes])
    for n in (16, 32, 64):
        assert model.predict(StepShape(n)) == pytest.approx(truth(n), rel=0.1)


def test_a_steps_cost_beyond_its_forward_pass_is_fitted_apart():
    # The warm-up times forward passes alone; the engine's steps cost 30 ms more. The overhead
    # takes the difference, the slope stays the warm-up's, and the tail, read against the
    # current fit, does not keep the misses of the first steps after warm-up.
    model = StepTimeModel()
    model.fit_warmup([(StepShape(n), 6e-4 * n) for n in (16, 64, 256, 1024, 2048)])
    rng = np.random.default_rng(0)
    first = None
    for _ in range(100):
        shape = StepShape(int(rng.integers(1, 64)), num_decodes=1)
        seconds = 0.030 + 6e-4 * shape.num_tokens
        first = first or seconds / model.predict(shape)
        model.observe(shape, seconds)
    assert first > 1.8  # the warm-up fit alone misses a small step by far
    assert model.overhead == pytest.approx(0.030, rel=1e-3)
    assert model.coefficients[1] == pytest.approx(6e-4, rel=1e-3)
    assert model.tail_seconds == pytest.approx(0.0, abs=1e-9)
    assert model.predict(StepShape(2048)) == pytest.approx(0.030 + 6e-4 * 2048, rel=1e-3)


def test_the_recent_window_follows_a_change():
    model = StepTimeModel(window=20)
    for t in range(1, 41):
        model.observe(StepShape(8 * t), 1e-3 * (1 if t <= 20 else 3))
    assert model.predict(StepShape(100)) == pytest.approx(3e-3, rel=1e-3)


def _seconds(truth: tuple[float, float, float, float], shape: StepShape) -> float:
    """(s, per token, per prefill pair, per decode key) -> the seconds of `shape`."""
    return (truth[0] + truth[1] * shape.num_tokens + truth[2] * shape.prefill_pairs
            + truth[3] * shape.decode_keys)


def test_decodes_do_not_price_the_prefill_pairs():
    # A decode's keys cost 100 times a chunk's query-key pairs, and nearly every step is decodes
    # only: one price for both would charge the decodes' to a chunk after a long context.
    truth = (2e-3, 5e-4, 2e-8, 2e-6)
    model = StepTimeModel()
    model.fit_warmup([(StepShape(t), truth[0] + truth[1] * t) for t in (16, 64, 256, 1024, 2048)])
    rng = np.random.default_rng(0)
    for i in range(300):
        decodes = int(rng.integers(1, 8))
        keys = decodes * int(rng.integers(100, 2000))
        chunk = 0 if i % 20 else int(rng.integers(16, 64))
        pairs = attended_pairs([(chunk, int(rng.integers(0, 1500)))])
        shape = StepShape(decodes + chunk, pairs, keys, decodes)
        model.observe(shape, _seconds(truth, shape))
    long_chunk = StepShape(1024, attended_pairs([(1024, 1000)]))
    assert model.predict(long_chunk) == pytest.approx(_seconds(truth, long_chunk), rel=0.02)


def test_steps_with_a_chunk_stay_in_the_fit_after_a_window_of_decodes():
    # The prefill pairs' price comes from the few steps with a chunk: a window of decode-only
    # steps after them does not push them out of the fit.
    truth = (2e-3, 5e-4, 2e-8, 2e-6)
    model = StepTimeModel(window=50)
    model.fit_warmup([(StepShape(t), truth[0] + truth[1] * t) for t in (16, 64, 256, 1024, 2048)])
    chunks = ((500, 0), (300, 800), (100, 1500))
    shapes = [StepShape(4 + n, attended_pairs([(n, c)]), 4000, 4) for n, c in chunks]
    shapes += [StepShape(4, 0, 4 * k, 4) for k in range(100, 200)]
    for shape in shapes:
        model.observe(shape, _seconds(truth, shape))
    long_chunk = StepShape(1024, attended_pairs([(1024, 1000)]))
    assert model.predict(long_chunk) == pytest.approx(_seconds(truth, long_chunk), rel=0.02)


def test_the_tail_is_the_slow_steps_time_beyond_their_prediction_per_decode():
    model = StepTimeModel()
    model.fit_warmup([(StepShape(t), 1e-3 + 1e-5 * t) for t in (16, 64, 256, 512)])
    assert model.tail_seconds == 0.0
    shapes = [StepShape(16 * (1 + i % 32), num_decodes=4) for i in range(100)]
    for shape in shapes[:MIN_TAIL_SAMPLES - 1]:
        model.observe(shape, model.predict(shape))
    assert model.tail_seconds == 0.0  # too few measured steps yet
    # Every tenth step runs 2 ms late, whatever its size, the others as predicted: the tail's
    # percentile is a late step's 2 ms (a ratio would have charged the large steps the small
    # ones' jitter).
    for i, shape in enumerate(shapes):
        model.observe(shape, model.predict(shape) + (2e-3 if i % 10 == 0 else 0.0))
    assert model.tail_seconds == pytest.approx(2e-3, rel=0.05)
    # Steps without decodes, however late, are no gap's wait: they do not count. Faster than
    # predicted never takes it below 0.
    for i, shape in enumerate(shapes):
        late = 50e-3 if i % 10 == 0 else 0.0
        model.observe(StepShape(shape.num_tokens), model.predict(shape) + late)
    assert model.tail_seconds == pytest.approx(2e-3, rel=0.05)
    fast = StepTimeModel()
    fast.fit_warmup([(StepShape(t), 1e-3 + 1e-5 * t) for t in (16, 64, 256, 512)])
    for shape in shapes:
        fast.observe(shape, 0.5 * (1e-3 + 1e-5 * shape.num_tokens))
    assert fast.tail_seconds == 0.0


def test_the_tail_leaves_the_late_steps_only_what_the_planned_misses_leave():
    # The target's percentile leaves 1% of the gaps over it, half of it (MISS_ALLOWANCE) for the
    # steps planned over it: the tail must cover all but the other half of the gaps. Here 2 of
    # 256 steps run 2 ms late, fewer than 1% of the gaps but more than that half.
    model = StepTimeModel()
    model.fit_warmup([(StepShape(t), 1e-3 + 1e-5 * t) for t in (16, 64, 256, 512)])
    shapes = [StepShape(16 * (1 + i % 32), num_decodes=4) for i in range(256)]
    assert MISS_ALLOWANCE < 2 / len(shapes) < 2 * MISS_ALLOWANCE
    for i, shape in enumerate(shapes):
        model.observe(shape, 1e-3 + 1e-5 * shape.num_tokens + (2e-3 if i % 150 == 0 else 0.0))
    assert model.tail_seconds == pytest.approx(2e-3, rel=0.05)


def test_the_tail_counts_each_step_once_per_decode():
    # One step of 100 decodes runs 3 ms late, 149 steps of 1 decode on time: under 1% of the
    # steps, but 100 of 249 gaps waited 3 ms longer, so the tail's percentile over gaps is late.
    model = StepTimeModel()
    model.fit_warmup([(StepShape(t), 1e-3 + 1e-5 * t) for t in (16, 64, 256, 512)])
    for i in range(150):
        shape = StepShape(128, num_decodes=100 if i == 75 else 1)
        model.observe(shape, model.predict(shape) + (3e-3 if i == 75 else 0.0))
    assert model.tail_seconds == pytest.approx(3e-3, rel=0.05)


def test_steps_predicted_over_the_limit_do_not_count_in_the_tail():
    # Whole-budget steps, taken when nothing fits the target, miss it whatever their error; a
    # long step's error, however small a fraction of it, would otherwise set the tail of all.
    warmup = [(StepShape(t), 1e-3 + 1e-5 * t) for t in (16, 64, 256, 512, 2048)]
    small, large = StepShape(16, num_decodes=4), StepShape(2048, num_decodes=4)
    tails = []
    for limit in (0.01, float("inf")):
        model = StepTimeModel(tail_limit_seconds=limit)
        model.fit_warmup(warmup)
        for i in range(100):
            model.observe(small, 1.16e-3 + (1e-3 if i % 50 == 0 else 0.0))
            if i % 10 == 0:  # 5 ms off either way: 1/10th of the gaps 5 ms late
                model.observe(large, 21.48e-3 + (5e-3 if i % 20 == 0 else -5e-3))
        assert model.predict(large) > 0.01 > model.predict(small)
        tails.append(model.tail_seconds)
    assert tails[0] == pytest.approx(1e-3, rel=0.1)
    assert tails[1] > 4e-3


def test_the_tail_shrinks_the_chosen_step():
    model = FakeStepTimes()
    args = dict(decode_keys=1, num_decodes=1, prefill_chunks=one_chunk(0), sizes=[], max_num_batched_tokens=4096)
    plain = latency_budget(model, 5e-3, **args)
    model.tail_seconds = 1e-3
    slow = latency_budget(model, 5e-3, **args)
    assert slow.num_tokens < plain.num_tokens < 4096
    one_more = slow.num_tokens + 1
    assert slow.predicted_seconds + 1e-3 <= 5e-3
    assert model.predict(StepShape(one_more, attended_pairs([(one_more - 1, 0)]), 1)) + 1e-3 > 5e-3


def test_a_step_without_decodes_takes_the_whole_budget():
    # Nobody waits between tokens in it: the target does not bound it, however tight.
    for sizes in ([], [16, 64, 256, 4096]):
        args = dict(prefill_chunks=one_chunk(0), sizes=sizes, max_num_batched_tokens=4096)
        chosen = latency_budget(FakeStepTimes(), 5e-3, decode_keys=0, num_decodes=0, **args)
        assert chosen.num_tokens == 4096 and chosen.predicted_seconds > 5e-3
        # With one decode a smaller step fits the target.
        assert latency_budget(FakeStepTimes(), 5e-3, decode_keys=1, num_decodes=1, **args).num_tokens < 4096


def test_the_drain_rate_raises_the_smallest_chunk():
    model, target = FakeStepTimes(), 5e-3
    args = dict(decode_keys=8, num_decodes=8, prefill_chunks=one_chunk(0), sizes=[], max_num_batched_tokens=4096)
    plain = latency_budget(model, target, **args)
    assert latency_budget(model, target, min_prefill_tokens=plain.num_tokens - 8 - 10, **args) == plain
    # A drain rate above what fits the target: the step misses it anyway, so it takes it all;
    # unless the target's percentile has no room for more misses: then the target wins.
    over = latency_budget(model, target, min_prefill_tokens=plain.num_tokens, **args)
    assert over.num_tokens == 4096
    for sizes in ([], BUCKETS):  # the largest step within the target, as without the drain rate
        sized = {**args, "sizes": sizes}
        within = latency_budget(model, target, **sized)
        assert within.num_tokens > 8 + MIN_PREFILL_CHUNK
        assert latency_budget(model, target, min_prefill_tokens=plain.num_tokens, may_miss=False, **sized) == within
    for sizes in ([], [16, 64, 256, 4096]):  # below the smallest step: the smallest step
        smallest = latency_budget(model, 1e-6, min_prefill_tokens=plain.num_tokens, may_miss=False,
                                  **{**args, "sizes": sizes})
        assert smallest.num_tokens == (8 + MIN_PREFILL_CHUNK if not sizes else 64)


def test_steps_may_miss_the_target_within_the_allowance_of_recent_gaps():
    model = StepTimeModel(tail_limit_seconds=0.05)
    on_time, late = StepShape(64, 0, 100, num_decodes=10), StepShape(512, 10_000, 100, num_decodes=10)
    assert not model.may_miss(1)  # no gaps yet: any miss is over the allowance
    gaps_for_one = round(10 / MISS_ALLOWANCE)  # ten missed gaps among these
    for _ in range(gaps_for_one // 10 - 1):
        model.observe(on_time, 0.01)
    assert model.may_miss(10) and not model.may_miss(11)
    model.observe(late, 0.2)  # its ten gaps missed: no room left for another such step
    assert not model.may_miss(10) and not model.may_miss(1)
    for _ in range(gaps_for_one // 10):
        model.observe(on_time, 0.01)
    assert model.may_miss(10)  # enough gaps since
    for _ in range(MISS_WINDOW_STEPS):
        model.observe(StepShape(64, 0, 100, num_decodes=1), 0.01)
    # Only the last MISS_WINDOW_STEPS steps count: on time, one gap each.
    assert model.may_miss(10) and not model.may_miss(11)
    model.observe(StepShape(512, 10_000, 0), 0.5)  # no decodes: no gap missed
    assert model.may_miss(10)


@settings(max_examples=300, deadline=None)
@given(target_ms=st.floats(0.5, 30), num_decodes=st.integers(0, 64), context=st.integers(0, 4000),
       short_context=st.integers(0, 200), short_need=st.integers(0, 600), decode_context=st.integers(0, 4000),
       warmed=st.booleans(), may_miss=st.booleans())
def test_the_chosen_step_is_the_largest_within_target_on_a_warmed_size(target_ms, num_decodes, context,
                                                                        short_context, short_need,
                                                                        decode_context, warmed, may_miss):
    model, target = FakeStepTimes(), target_ms / 1000
    sizes = BUCKETS if warmed else []
    decode_keys = (decode_context + 1) * num_decodes

    def chunks(num_tokens: int) -> list[tuple[int, int]]:
        # A long prompt after `context` tokens, and short prompts wanting up to `short_need`.
        short = min(num_tokens // 2, short_need)
        return [(num_tokens - short, context), (short, short_context)]

    chosen = latency_budget(model, target, decode_keys=decode_keys, num_decodes=num_decodes,
                            prefill_chunks=chunks, sizes=sizes, max_num_batched_tokens=512,
                            may_miss=may_miss)

    def predicted(total: int) -> float:
        padded = next((b for b in sizes if b >= total), total)
        return model.predict(StepShape(padded, attended_pairs(chunks(total - num_decodes)), decode_keys))

    assert chosen.num_tokens <= 512
    assert chosen.num_tokens - num_decodes >= MIN_PREFILL_CHUNK  # progress, target or not
    assert chosen.predicted_seconds == pytest.approx(predicted(chosen.num_tokens))
    allowed = [b for b in BUCKETS if b >= num_decodes + MIN_PREFILL_CHUNK] if warmed else \
        list(range(num_decodes + MIN_PREFILL_CHUNK, 513))
    if warmed:
        assert chosen.num_tokens in BUCKETS  # never a size without a graph
    if num_decodes == 0 or (predicted(allowed[0]) > target and may_miss):
        # Nobody waits on the step, or its decodes miss the target whatever the chunk: all of it.
        assert chosen.num_tokens == 512
    elif predicted(allowed[0]) > target:
        assert chosen.num_tokens == allowed[0]  # no room for misses: the smallest step
    else:
        assert chosen.predicted_seconds <= target  # within target when a smaller chunk is
        larger = [s for s in allowed if s > chosen.num_tokens]
        assert not larger or predicted(larger[0]) > target  # the largest within target


def _latency_engine(target_ms: float, budget: int = 512, may_miss: bool = True, **kwargs) -> FakeEngine:
    eng = FakeEngine(budget=budget, max_num_seqs=16, max_model_len=2048, num_blocks=512, block_size=16,
                     max_step_latency_ms=target_ms, **kwargs)
    eng.sched.step_time_model = FakeStepTimes(may_miss)
    eng.sched.token_buckets = BUCKETS
    return eng


def test_the_scheduler_sizes_steps_under_the_target_and_always_progresses():
    eng = _latency_engine(7.0)
    eng.add("long", 1500, max_tokens=8)
    for i in range(6):
        eng.add(f"chat{i}", 20, max_tokens=30)
    steps = eng.run()
    sized = [out for out in steps if out.token_budget is not None]
    assert sized and all(s.is_finished for s in eng.seqs.values())
    for out in sized:
        assert out.num_batched_tokens <= out.token_budget <= 512
        assert out.token_budget in BUCKETS
        assert out.num_prefill_tokens > 0  # a prompt waited or was mid-prefill: it progressed
        if out.num_decodes == 0:
            assert out.token_budget == 512  # nobody waits between tokens: the whole budget
        else:
            assert out.predicted_seconds <= 7e-3 or out.token_budget == 512
    assert sized[0].num_decodes == 0 and sized[0].num_batched_tokens > 256
    # Later chunks of the long prompt attend more context: the budget shrinks as it proceeds
    # (up to its last chunk, which fills no budget).
    long_budgets = [out.token_budget for out in sized if out.num_decodes and out.num_batched_tokens == out.token_budget
                    and "long" in [s.request_id for s in out.scheduled]]
    assert long_budgets[0] > long_budgets[-1]
    # Decode-only steps are not sized.
    assert all(out.token_budget is None for out in steps if out.num_prefill_tokens == 0)


def test_short_prompts_beside_a_long_one_are_priced_after_their_own_context():
    # The scheduler gives a long prompt deep in its prefill half of the budget and the short
    # prompts beside it the rest: the step is priced so, not as all of it after the long
    # prompt's context, which would size it well under the target.
    eng = _latency_engine(7.0, long_prefill_token_threshold=0)
    eng.sched.token_buckets = []  # any size: the difference is not lost between two buckets
    eng.add("long", 1900, max_tokens=8)
    for i in range(4):
        eng.add(f"d{i}", 20, max_tokens=100)
    while eng.seqs["long"].num_computed_tokens < 1300:
        eng.step()
    for i in range(6):
        eng.add(f"chat{i}", 60, max_tokens=30)
    out = eng.step()
    chunks = {s.request_id: (s.num_tokens, s.context_len) for s in out.scheduled[out.num_decodes:]}
    assert "long" in chunks and "chat0" in chunks and chunks["long"][1] >= 1300
    assert out.num_batched_tokens == out.token_budget and out.predicted_seconds <= 7e-3
    decode_keys = sum(s.context_len + 1 for s in out.scheduled[:out.num_decodes])
    one_context = latency_budget(eng.sched.step_time_model, 7e-3, decode_keys=decode_keys,
                                 num_decodes=out.num_decodes, prefill_chunks=one_chunk(chunks["long"][1]),
                                 sizes=[], max_num_batched_tokens=512)
    assert out.token_budget > one_context.num_tokens + 16


def test_without_a_target_or_a_model_the_budget_is_max_num_batched_tokens():
    eng = FakeEngine(budget=512, max_model_len=2048, num_blocks=512, block_size=16)
    eng.add("a", 1500, max_tokens=1)
    assert eng.step().num_batched_tokens == 512
    eng = FakeEngine(budget=512, max_model_len=2048, num_blocks=512, block_size=16, max_step_latency_ms=1.0)
    eng.add("a", 1500, max_tokens=1)  # no model fitted yet
    out = eng.step()
    assert out.num_batched_tokens == 512 and out.token_budget is None


def test_a_target_below_any_step_with_decodes_takes_the_whole_budget():
    eng = _latency_engine(0.01)
    eng.add("a", 100, max_tokens=50)
    assert eng.step().num_batched_tokens == 100  # no decodes yet: the whole prompt
    eng.add("b", 1000, max_tokens=1)
    out = eng.step()
    # Its decode misses the target whatever the chunk: b's prefill goes as fast as it may.
    assert out.num_decodes == 1 and out.token_budget == 512 and out.predicted_seconds > 1e-5
    assert out.num_prefill_tokens == min(511, eng.sched.config.long_prefill_token_threshold or 511)


def test_the_prefill_keeps_up_with_arrivals_under_a_tight_target():
    # A 120-token prompt arrives every step, while each step fits about 30 prefill tokens under
    # 2 ms beside its decodes: sized by the target alone, the queue would grow by a prompt every
    # few steps. The drain rate lifts the chunk to the arrivals.
    eng = _latency_engine(2.0, max_num_partial_prefills=8)
    for i in range(600):
        eng.add(f"r{i}", 120, max_tokens=4)
        eng.step()
    late = eng.outputs[-200:]
    assert all(out.num_decodes > 0 for out in late)
    assert sum(out.num_prefill_tokens for out in late) / len(late) >= 119
    assert len(eng.sched.waiting) <= 8
    assert eng.run(max_steps=100)  # drains


def test_without_room_for_misses_the_target_wins_over_the_arrivals():
    # The arrivals of the test above: where the target's percentile has room for misses, steps
    # with decodes go over the target to keep up; where it has none, none does.
    def sized_steps(may_miss: bool) -> list:
        eng = _latency_engine(2.0, may_miss=may_miss, max_num_partial_prefills=8)
        for i in range(600):
            eng.add(f"r{i}", 120, max_tokens=4)
            eng.step()
        assert eng.run(max_steps=1000)  # drains
        return [out for out in eng.outputs if out.token_budget is not None and out.num_decodes]

    assert any(out.predicted_seconds > 2e-3 for out in sized_steps(may_miss=True))
    strict = sized_steps(may_miss=False)
    assert strict and all(out.predicted_seconds <= 2e-3 for out in strict)
    assert all(out.num_prefill_tokens > 0 for out in strict)  # progress all the same


@pytest.mark.parametrize("kwargs", [{"max_step_latency_ms": 0}, {"max_step_latency_ms": -5.0},
                                    {"max_step_latency_ms": 50.0, "enable_chunked_prefill": False}])
def test_bad_targets_are_refused_naming_the_field(kwargs):
    from vllm.config import SchedulerConfig
    with pytest.raises(ValueError, match="max_step_latency_ms"):
        SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=4, max_model_len=4096, **kwargs)
