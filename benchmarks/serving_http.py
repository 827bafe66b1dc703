"""The HTTP side of benchmark_serving.py: streamed OpenAI requests, /metrics scrapes, and
`vllm serve` started as a subprocess for --compare-chunked."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx2

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Counters and histogram sums of the server's /metrics that a run reports (vLLM's names).
SERVER_METRICS = ("vllm:num_steps_total", "vllm:num_mixed_steps_total", "vllm:num_preemptions_total",
                  "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                  "vllm:prefill_chunk_tokens_count", "vllm:prefill_chunk_tokens_sum",
                  "vllm:prefix_cache_hits_total",
                  "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
                  "vllm:e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_count")


@dataclass
class RequestRecord:
    request_id: str
    prompt_len: int
    expected_output_len: int
    kind: str
    arrival: float                      # scheduled arrival, seconds after the run's start
    token_times: list[float] = field(default_factory=list)  # seconds after the start, one per chunk
    finish: float | None = None
    error: str | None = None
    generated_text: str = ""
    output_tokens: int | None = None  # the server's count (usage), when it sent one

    @property
    def success(self) -> bool:
        return self.error is None and self.finish is not None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def latency(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def request_body(endpoint: str, model: str, prompt_token_ids: list[int], prompt_text: str,
                 output_len: int, ignore_eos: bool) -> dict:
    """A streamed, greedy request for `output_len` tokens (usage included, as vLLM's client asks)."""
    body = {"model": model, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": ignore_eos,
            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt_text}]
    else:
        body["prompt"] = prompt_token_ids  # token ids: the prompt has exactly its length
    return body


async def send_request(http: httpx2.AsyncClient, url: str, body: dict, record: RequestRecord,
                       start: float) -> None:
    """Streams one request, timing every chunk that carries text (one per token)."""
    chat = "messages" in body
    try:
        async with http.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    record.finish = time.perf_counter() - start
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = chunk["error"].get("message", "error event")
                    return
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices")
                if not choices:
                    continue
                # As vLLM's client: every completion chunk is a token; a chat chunk is one when it
                # has content (the first, which only names the role, is not).
                text = choices[0]["delta"].get("content") if chat else choices[0].get("text")
                if text or not chat:
                    record.token_times.append(time.perf_counter() - start)
                    record.generated_text += text or ""
    except httpx2.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"


async def run_requests(url: str, bodies: list[dict], records: list[RequestRecord],
                       max_concurrency: int | None, timeout: float | None) -> float:
    """Sends each request at its record's arrival time (open loop; at most `max_concurrency` in
    flight when set); returns the run's duration in seconds."""
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with httpx2.AsyncClient(limits=limits, timeout=httpx2.Timeout(timeout or 6 * 3600)) as http:
        start = time.perf_counter()

        async def one(body: dict, record: RequestRecord) -> None:
            await asyncio.sleep(max(0.0, record.arrival - (time.perf_counter() - start)))
            if semaphore is None:
                await send_request(http, url, body, record, start)
            else:
                async with semaphore:
                    await send_request(http, url, body, record, start)

        tasks = [asyncio.create_task(one(b, r)) for b, r in zip(bodies, records)]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    for record in records:
        if record.finish is None and record.error is None:
            record.error = "timeout" if pending else "stream ended without [DONE]"
    return duration


def scrape_metrics(base_url: str) -> dict[str, float]:
    """The server's vLLM counters and histogram sums (summed over labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx2.get(f"{base_url}/metrics", timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in SERVER_METRICS:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def server_report(before: dict[str, float], after: dict[str, float], client_ttfts: list[float],
                  client_e2els: list[float]) -> dict:
    """What the server counted during a run, and its overhead per request: the client's mean TTFT
    and E2E latency minus the engine's own (arrival in the engine to first token / finish), i.e.
    HTTP, JSON and the async hand-off, in milliseconds."""
    d = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in SERVER_METRICS}
    report = {"steps": int(d["vllm:num_steps_total"]), "mixed_steps": int(d["vllm:num_mixed_steps_total"]),
              "preemptions": int(d["vllm:num_preemptions_total"]),
              "prompt_tokens": int(d["vllm:prompt_tokens_total"]),
              "generation_tokens": int(d["vllm:generation_tokens_total"]),
              "prefill_chunks": int(d["vllm:prefill_chunk_tokens_count"]),
              "prefix_cache_hits": int(d["vllm:prefix_cache_hits_total"]),
              "mean_prefill_chunk_tokens": (d["vllm:prefill_chunk_tokens_sum"] / d["vllm:prefill_chunk_tokens_count"]
                                            if d["vllm:prefill_chunk_tokens_count"] else None)}
    n_ttft, n_e2e = d["vllm:time_to_first_token_seconds_count"], d["vllm:e2e_request_latency_seconds_count"]
    if n_ttft and client_ttfts:
        engine_ttft = 1000 * d["vllm:time_to_first_token_seconds_sum"] / n_ttft
        report["engine_mean_ttft_ms"] = engine_ttft
        report["overhead_ttft_ms"] = 1000 * sum(client_ttfts) / len(client_ttfts) - engine_ttft
    if n_e2e and client_e2els:
        engine_e2el = 1000 * d["vllm:e2e_request_latency_seconds_sum"] / n_e2e
        report["engine_mean_e2el_ms"] = engine_e2el
        report["overhead_e2el_ms"] = 1000 * sum(client_e2els) / len(client_e2els) - engine_e2el
    return report


# --------------------------------------------------------------------------- a server of our own

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LaunchedServer:
    """`vllm serve` in a subprocess on a free loopback port; `with` waits for /health and, on
    exit, stops it with SIGTERM (a graceful shutdown)."""

    def __init__(self, model: str | None, flags: list[str], log_path: str | None = None,
                 startup_timeout: float = 900.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve",
                    *([model] if model else []), "--host", "127.0.0.1", "--port", str(self.port), *flags]
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    def __enter__(self) -> LaunchedServer:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
        self._log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        start = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = start + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`{' '.join(self.cmd)}` exited with {self.proc.returncode}"
                                   + (f"; see {self.log_path}" if self.log_path else ""))
            try:
                if httpx2.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            if time.perf_counter() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"the server did not come up in {self.startup_timeout:.0f} s")
            time.sleep(0.25)
        self.startup_seconds = time.perf_counter() - start
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
