"""`max_step_latency_ms` end to end on the tiny random Llama: steps sized by the fitted
step-time model give the same greedy tokens as fixed budgets, and their budgets and predicted
and measured times reach the stat loggers and /metrics."""

import logging
import time

from prometheus_client import CollectorRegistry, generate_latest

from tests.test_metrics import Recorder
from tests.utils import random_prompts
from vllm import LLM, SamplingParams
from vllm.core.step_time_model import MIN_PREFILL_CHUNK, StepShape
from vllm.engine.metrics import LoggingStatLogger, PrometheusStatLogger

LENGTHS = [100, 7, 60, 5, 3, 90]


class _FakeStepTimes:
    """What the scheduler and the engine ask of a step-time model; predictions from subclasses."""

    is_fitted, tail_seconds = True, 0.0

    def observe(self, shape: StepShape, seconds: float) -> None:
        pass

    def may_miss(self, num_decodes: int) -> bool:
        return True


def _run(path: str, **kwargs):
    llm = LLM(path, dtype="float32", max_model_len=128, block_size=16, max_num_batched_tokens=64,
              max_num_seqs=8, enforce_eager=True, **kwargs)
    recorder = Recorder()
    llm.llm_engine.add_logger("recorder", recorder)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(LENGTHS, seed=5)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.do_log_stats()
    return [o.outputs[0].token_ids for o in outs], [s.iteration for s in recorder.stats], llm


def test_a_latency_target_keeps_greedy_tokens_and_reports_its_budgets(tiny_checkpoints, caplog):
    reference, plain_its, _ = _run(tiny_checkpoints["llama"])
    assert not any(i.step_token_budgets for i in plain_its)  # no target: nothing sized

    # A target below any step's predicted time.
    tokens, its, llm = _run(tiny_checkpoints["llama"], max_step_latency_ms=1e-3, enable_prefix_caching=False)
    assert tokens == reference
    model = llm.llm_engine.scheduler.step_time_model
    assert model.is_fitted and model.predict(StepShape(64)) > 0
    # Fitted on the 6 token sizes (2, 4, ..., 64), then on every step run.
    assert model.num_observations == 6 + llm.llm_engine.stats.num_steps
    budgets = [b for i in its for b in i.step_token_budgets]
    measured = [t for i in its for t in i.measured_step_seconds]
    predicted = [t for i in its for t in i.predicted_step_seconds]
    assert budgets and len(budgets) == len(measured) == len(predicted)
    # Far below any step: a step without decodes has nobody waiting on it (the whole budget); one
    # with decodes misses the target whatever its chunk, and as every step missed it, the
    # target's percentile has no room for misses: the smallest step, its decodes (at most 6)
    # and MIN_PREFILL_CHUNK (eager: any size).
    smallest = range(1 + MIN_PREFILL_CHUNK, 7 + MIN_PREFILL_CHUNK)
    assert all(b == 64 or b in smallest for b in budgets) and any(b in smallest for b in budgets)
    assert all(t > 0 for t in measured)

    # Steps cut short beside decodes give the same tokens: a model that fits 40 tokens in the
    # target (no prefix cache, so that the same prompts run again from their first token).
    class FortyTokens(_FakeStepTimes):
        def predict(self, shape: StepShape) -> float:
            return 1e-6 * shape.num_tokens / 40

    llm.llm_engine.scheduler.step_time_model = FortyTokens()
    cut = Recorder()
    llm.llm_engine.add_logger("cut", cut)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(LENGTHS, seed=5)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.do_log_stats()
    llm.llm_engine.remove_logger("cut")
    assert [o.outputs[0].token_ids for o in outs] == reference
    cut_budgets = [b for st in cut.stats for b in st.iteration.step_token_budgets]
    assert 64 in cut_budgets and any(16 <= b <= 40 for b in cut_budgets)

    # The log line and Prometheus carry them.
    registry = CollectorRegistry()
    engine = llm.llm_engine
    engine.add_logger("prometheus", PrometheusStatLogger(registry, "tiny", 128, 64))
    engine.add_logger("line", LoggingStatLogger(interval_s=1e-9))
    monkeypatch_logger = logging.getLogger("vllm")
    propagate, monkeypatch_logger.propagate = monkeypatch_logger.propagate, True  # to caplog's handler
    try:
        with caplog.at_level(logging.INFO):
            llm.generate([{"prompt_token_ids": random_prompts([50], seed=9)[0]}],
                         SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    finally:
        monkeypatch_logger.propagate = propagate
    text = generate_latest(registry).decode()
    assert 'vllm:step_token_budget{model_name="tiny"}' in text
    assert 'vllm:step_time_seconds_count{model_name="tiny"}' in text
    assert 'vllm:step_time_predicted_seconds_count{model_name="tiny"}' in text
    assert "Step budget:" in caplog.text and "step time predicted:" in caplog.text


def test_a_decode_steps_time_runs_from_the_previous_steps_outputs(tiny_checkpoints):
    # A decode's gap starts when the step before gave its previous token: what runs between the
    # steps (a server streaming the outputs) is in it, and so in the model's fit and its tail.
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", max_model_len=128, block_size=16,
              max_num_batched_tokens=64, max_num_seqs=8, enforce_eager=True, max_step_latency_ms=50.0)

    class Recording(_FakeStepTimes):
        def __init__(self) -> None:
            self.observed: list[tuple[StepShape, float]] = []

        def predict(self, shape: StepShape) -> float:
            return 0.0

        def observe(self, shape: StepShape, seconds: float) -> None:
            self.observed.append((shape, seconds))

    engine = llm.llm_engine
    engine.scheduler.step_time_model = model = Recording()
    engine.add_request("a", {"prompt_token_ids": random_prompts([20], seed=3)[0]},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    between = 0.05
    while engine.has_unfinished_requests():
        engine.step()
        time.sleep(between)
    assert [shape.num_decodes for shape, _ in model.observed] == [0, 1, 1, 1]
    assert all(seconds >= between for shape, seconds in model.observed if shape.num_decodes)
