"""The engine's stats for its loggers, vLLM's periodic log line, and /metrics with vLLM's names."""

import logging
import time

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_utils import ServerThread
from tests.utils import random_prompts
from vllm import LLM, AsyncLLMEngine, SamplingParams
from vllm.engine.metrics import LoggingStatLogger, buckets_1_2_5
from vllm.engine.metrics_types import IterationStats, StatLoggerBase, Stats
from vllm.entrypoints.openai.api_server import build_app

MODEL = "tiny"


class Recorder(StatLoggerBase):
    def __init__(self) -> None:
        self.stats: list[Stats] = []

    def log(self, stats: Stats) -> None:
        self.stats.append(stats)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], dtype="float32", max_model_len=256, block_size=16,
               max_num_batched_tokens=32, max_num_seqs=8, enforce_eager=True, kv_cache_memory_bytes=32 * 2**20)



def test_model_forward_seconds_are_a_part_of_each_step(llm):
    """Every step that runs the model adds its time there, and never more than the step took:
    a step of prefill chunks that samples nothing too (its budget of 32 cuts the 70 tokens)."""
    engine = llm.llm_engine
    engine.add_request("fwd", {"prompt_token_ids": random_prompts([70], seed=5)[0]},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    parts = []
    while engine.has_unfinished_requests():
        before, start = engine.stats.model_forward_seconds, time.perf_counter()
        outputs = engine.step()
        parts.append((engine.stats.model_forward_seconds - before, time.perf_counter() - start, bool(outputs)))
    assert len(parts) == 3 + 3 and not parts[0][2]  # 32 + 32 + 6 prompt tokens, then 3 decodes
    for forward, wall, _ in parts:
        assert 0 < forward < wall

def test_engine_stats_add_up(llm):
    engine = llm.llm_engine
    recorder = Recorder()
    engine.add_logger("recorder", recorder)
    try:
        lengths = [70, 5, 40, 9]
        prompts = [{"prompt_token_ids": p} for p in random_prompts(lengths, seed=3)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        engine.add_request("gone", {"prompt_token_ids": random_prompts([20])[0]}, SamplingParams(max_tokens=50))
        engine.step()
        engine.step()
        engine.abort_request("gone")
        engine.do_log_stats()
    finally:
        engine.remove_logger("recorder")
    its = [s.iteration for s in recorder.stats]
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert sum(i.num_prompt_tokens for i in its) == sum(lengths) + 20
    assert sum(i.num_generation_tokens for i in its) == generated + 2  # "gone" got 2 tokens in 2 steps
    assert sum(len(i.time_to_first_tokens) for i in its) == 5
    assert sum(len(i.inter_token_latencies) for i in its) == generated - 4 + 1
    assert sum(sum(i.prefill_chunk_tokens) for i in its) == sum(lengths) + 20  # nothing recomputed
    assert max(max(i.step_num_tokens, default=0) for i in its) == 32  # the budget filled
    assert sum(s.num_mixed_steps for s in recorder.stats) > 0  # chunks rode along with decodes
    finished = [r for i in its for r in i.finished_requests]
    assert sorted(r.finish_reason for r in finished) == ["abort"] + ["length"] * 4
    for r in finished:
        assert r.e2e_latency >= r.queue_time + r.prefill_time + r.decode_time - 1e-6
    last = recorder.stats[-1]
    assert last.num_running == last.num_waiting == 0 and last.kv_cache_usage == 0.0
    assert recorder.stats[0].num_running > 0 and recorder.stats[0].kv_cache_usage > 0


def stats(now: float, prompt: int = 0, generation: int = 0, running: int = 0, queries: int = 0,
          hits: int = 0) -> Stats:
    return Stats(now=now, num_running=running, num_waiting=1, kv_cache_usage=0.25, num_steps=1,
                 num_mixed_steps=0, num_preemptions=0, num_prefix_cache_queries=queries,
                 num_prefix_cache_hits=hits,
                 iteration=IterationStats(num_prompt_tokens=prompt, num_generation_tokens=generation))


def test_log_line(caplog):
    stat_logger = LoggingStatLogger(interval_s=10.0)
    start = stat_logger.last_log_time
    with caplog.at_level(logging.INFO, logger="vllm.engine.metrics"):
        stat_logger.log(stats(start + 1, prompt=300, generation=50, running=2, queries=200, hits=50))
        assert not caplog.records  # not yet: the interval has not passed
        stat_logger.log(stats(start + 20, prompt=100, generation=50, running=2))
        assert caplog.records[-1].getMessage() == (
            "Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 2 reqs, "
            "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")
        stat_logger.log(stats(start + 30, generation=10))
        assert "Avg generation throughput: 1.0 tokens/s" in caplog.records[-1].getMessage()


def test_buckets():
    assert buckets_1_2_5(256) == [1, 2, 5, 10, 20, 50, 100, 200]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels without model_name) -> value."""
    text = httpx2.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_endpoint(llm, caplog):
    engine = AsyncLLMEngine(llm.llm_engine)
    with ServerThread(build_app(engine, [MODEL])) as server:
        assert llm.reset_prefix_cache()
        before = scrape(server.url)
        # Two prompts of 40 tokens, then the first again: its 2 full blocks of 16 come from the
        # prefix cache, and only its last 8 tokens are computed.
        first, second = random_prompts([40, 40], seed=5)
        for prompt in (first, second, first):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "ignore_eos": True}
            assert httpx2.post(f"{server.url}/v1/completions", json=body).status_code == 200
        after = scrape(server.url)
        text = httpx2.get(f"{server.url}/metrics").text
    delta = lambda name, labels=(): after[(name, labels)] - before.get((name, labels), 0)  # noqa: E731
    assert delta("vllm:prompt_tokens_total") == 120
    assert delta("vllm:generation_tokens_total") == 15
    assert delta("vllm:request_success_total", (("finished_reason", "length"),)) == 3
    assert delta("vllm:request_success_total", (("finished_reason", "abort"),)) == 0
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == 12
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:request_prompt_tokens_sum") == 120
    assert delta("vllm:prefill_chunk_tokens_sum") == 40 + 40 + 8
    assert delta("vllm:prefix_cache_queries_total") == 120 and delta("vllm:prefix_cache_hits_total") == 32
    assert delta("vllm:num_steps_total") >= 3 * 5 and ("vllm:num_mixed_steps_total", ()) in after
    assert after[("vllm:num_requests_running", ())] == after[("vllm:num_requests_waiting", ())] == 0
    assert after[("vllm:kv_cache_usage_perc", ())] == 0
    for name in ("vllm:num_preemptions_total", "vllm:request_queue_time_seconds_count",
                 "vllm:request_decode_time_seconds_count", "vllm:iteration_tokens_total_count"):
        assert (name, ()) in after
    assert 'model_name="tiny"' in text
