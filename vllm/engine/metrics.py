"""The engine's two stat loggers: vLLM's periodic log line and Prometheus metrics with vLLM's names.

Besides vLLM's metrics, two chunked-prefill ones: `vllm:num_mixed_steps` (steps that ran decodes
and prefill chunks together, out of `vllm:num_steps`) and `vllm:prefill_chunk_tokens` (the size
of every prefill chunk scheduled). With `max_step_latency_ms`, three of the latency target:
`vllm:step_token_budget` (the budget of the last step it sized), `vllm:step_time_predicted_seconds`
and `vllm:step_time_seconds` (each such step's predicted and measured time); the log line adds
their averages.
"""

import logging
import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm.engine.metrics_types import Stats, StatLoggerBase

logger = logging.getLogger(__name__)

DEFAULT_LOG_INTERVAL_S = 10.0

# Histogram buckets, in seconds, as vLLM's.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


def log_interval_from_env() -> float:
    """VLLM_LOG_STATS_INTERVAL: seconds between two log lines (vLLM's variable)."""
    value = os.environ.get("VLLM_LOG_STATS_INTERVAL", str(DEFAULT_LOG_INTERVAL_S))
    try:
        interval = float(value)
    except ValueError:
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL={value!r} is not a number of seconds") from None
    if interval <= 0:
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL must be > 0 seconds, got {value}")
    return interval


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: buckets for token counts."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > limit:
                return buckets
            buckets.append(value)
        scale *= 10


class LoggingStatLogger(StatLoggerBase):
    """Logs vLLM's line every `interval_s`: average prompt and generation throughput since the last
    line, running and waiting requests, KV cache usage and the prefix cache hit rate. An engine
    that stays idle logs one line, then nothing until it works again."""

    def __init__(self, interval_s: float = DEFAULT_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.last_log_time = time.monotonic()
        self.last_line_idle = False
        self._reset()

    def _reset(self) -> None:
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.num_prefix_queries = self.num_prefix_hits = 0
        self.step_budgets: list[int] = []
        self.predicted_seconds: list[float] = []
        self.measured_seconds: list[float] = []

    def _latency_target_text(self) -> str:
        """The latency target's averages since the last line, or "" when no step was sized by it."""
        if not self.step_budgets:
            return ""
        n = len(self.step_budgets)
        return (f", Step budget: {sum(self.step_budgets) / n:.0f} tokens, step time predicted: "
                f"{1e3 * sum(self.predicted_seconds) / n:.1f} ms, measured: "
                f"{1e3 * sum(self.measured_seconds) / n:.1f} ms")

    def log(self, stats: Stats) -> None:
        self.num_prompt_tokens += stats.iteration.num_prompt_tokens
        self.num_generation_tokens += stats.iteration.num_generation_tokens
        self.step_budgets += stats.iteration.step_token_budgets
        self.predicted_seconds += stats.iteration.predicted_step_seconds
        self.measured_seconds += stats.iteration.measured_step_seconds
        self.num_prefix_queries += stats.num_prefix_cache_queries
        self.num_prefix_hits += stats.num_prefix_cache_hits
        elapsed = stats.now - self.last_log_time
        if elapsed < self.interval_s:
            return
        idle = not (self.num_prompt_tokens or self.num_generation_tokens or stats.num_running
                    or stats.num_waiting)
        if not (idle and self.last_line_idle):
            hit_rate = self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%%s",
                self.num_prompt_tokens / elapsed, self.num_generation_tokens / elapsed,
                stats.num_running, stats.num_waiting, 100 * stats.kv_cache_usage, 100 * hit_rate,
                self._latency_target_text())
        self.last_line_idle = idle
        self.last_log_time = stats.now
        self._reset()


class PrometheusStatLogger(StatLoggerBase):
    """vLLM's Prometheus metrics, labelled with the served model name, in `registry`."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int,
                 max_num_batched_tokens: int) -> None:
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: list) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(model_name)

        token_buckets = buckets_1_2_5(max_model_len)
        step_buckets = buckets_1_2_5(max_num_batched_tokens)
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 means 100 percent).")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of the number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of the number of cached tokens.")
        self.steps = counter("vllm:num_steps", "Engine steps run.")
        self.mixed_steps = counter("vllm:num_mixed_steps",
                                   "Engine steps that ran decodes and prefill chunks together.")
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                labels + ["finished_reason"], registry=registry)
        self._model_name = model_name
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)  # exported at 0 from the start
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of the number of tokens per engine step.", step_buckets)
        self.prefill_chunk_tokens = histogram("vllm:prefill_chunk_tokens",
                                              "Histogram of the size of prefill chunks.", step_buckets)
        self.step_token_budget = gauge("vllm:step_token_budget",
                                       "Token budget the latency target chose for the last step it sized.")
        self.step_time_predicted = histogram("vllm:step_time_predicted_seconds",
                                             "Histogram of predicted engine step time in seconds, of "
                                             "steps sized by the latency target.", ITL_BUCKETS)
        self.step_time = histogram("vllm:step_time_seconds",
                                   "Histogram of measured engine step time in seconds, of steps "
                                   "sized by the latency target.", ITL_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.",
                                     REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)

    def log(self, stats: Stats) -> None:
        it = stats.iteration
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.preemptions.inc(stats.num_preemptions)
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        self.prefix_queries.inc(stats.num_prefix_cache_queries)
        self.prefix_hits.inc(stats.num_prefix_cache_hits)
        self.steps.inc(stats.num_steps)
        self.mixed_steps.inc(stats.num_mixed_steps)
        for values, histogram in ((it.step_num_tokens, self.iteration_tokens),
                                  (it.prefill_chunk_tokens, self.prefill_chunk_tokens),
                                  (it.time_to_first_tokens, self.ttft),
                                  (it.inter_token_latencies, self.itl),
                                  (it.predicted_step_seconds, self.step_time_predicted),
                                  (it.measured_step_seconds, self.step_time)):
            for value in values:
                histogram.observe(value)
        if it.step_token_budgets:
            self.step_token_budget.set(it.step_token_budgets[-1])
        for request in it.finished_requests:
            self._success.labels(self._model_name, request.finish_reason).inc()
            self.e2e.observe(request.e2e_latency)
            self.request_prompt_tokens.observe(request.num_prompt_tokens)
            self.request_generation_tokens.observe(request.num_generation_tokens)
            for value, histogram in ((request.queue_time, self.queue_time),
                                     (request.prefill_time, self.prefill_time),
                                     (request.decode_time, self.decode_time)):
                if value is not None:
                    histogram.observe(value)
