"""A load test of the server on the tiny Llama: 500 streamed requests arriving open-loop (Poisson),
prompts of 5 to 2000 tokens, one client in ten leaving mid-stream. Every other request completes
with exactly its max_tokens, the server stays up, every KV block is free afterwards, and /metrics
counts what was sent. The KV cache is small enough that some requests are preempted (recomputed):
their prompts still count once."""

import asyncio
import json
import random
import time

import httpx2
import pytest

from tests.server_utils import ServerThread
from tests.test_metrics import scrape
from tests.utils import build_tiny_checkpoint, random_prompts
from vllm import AsyncLLMEngine, EngineArgs
from vllm.entrypoints.openai.api_server import build_app

NUM_REQUESTS = 500
RATE = 80.0  # requests per second, open loop: arrivals do not wait for earlier requests
DISCONNECT_FRACTION = 0.1
LEAVER_MAX_TOKENS = 200  # a client that leaves asks for many tokens: an abort shows as far fewer
MODEL = "tiny"


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tokenizer_dir):
    path = build_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("long") / "llama"), tokenizer_dir,
                                 max_position_embeddings=2304)
    return AsyncLLMEngine.from_engine_args(EngineArgs(
        model=path, dtype="float32", max_model_len=2304, block_size=16, max_num_batched_tokens=512,
        max_num_seqs=32, kv_cache_memory_bytes=4 * 2**20, enforce_eager=True))


def workload(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    requests = []
    for i in range(NUM_REQUESTS):
        kind = rng.random()
        length = rng.randint(5, 200) if kind < 0.8 else rng.randint(200, 1000) if kind < 0.95 \
            else rng.randint(1000, 2000)
        leaves = rng.random() < DISCONNECT_FRACTION
        requests.append({
            "prompt": random_prompts([length], seed=seed * 100_000 + i)[0],
            "max_tokens": LEAVER_MAX_TOKENS if leaves else rng.randint(4, 32),
            "leave_after": rng.randint(1, 3) if leaves else None})
    return requests


async def one_request(http: httpx2.AsyncClient, url: str, request: dict, delay: float) -> dict:
    await asyncio.sleep(delay)
    body = {"model": MODEL, "prompt": request["prompt"], "max_tokens": request["max_tokens"],
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events = []
    async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if request["leave_after"] is not None and len(events) == request["leave_after"]:
                break  # leaving the block closes the connection mid-stream
    return {"events": events}


async def run_load(url: str, requests: list[dict]) -> list[dict]:
    rng = random.Random(1)
    t, delays = 0.0, []
    for _ in requests:
        t += rng.expovariate(RATE)
        delays.append(t)
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx2.AsyncClient(limits=limits, timeout=120) as http:
        return await asyncio.gather(*(one_request(http, url, r, d) for r, d in zip(requests, delays)))


def test_load_with_disconnects(engine):
    requests = workload()
    leavers = [r for r in requests if r["leave_after"] is not None]
    assert 30 <= len(leavers) <= 70 and max(len(r["prompt"]) for r in requests) > 1800
    with ServerThread(build_app(engine, [MODEL])) as server:
        before = scrape(server.url)
        start = time.monotonic()
        results = asyncio.run(run_load(server.url, requests))
        elapsed = time.monotonic() - start
        deadline = time.monotonic() + 10
        while engine.num_unfinished_requests or engine.engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "requests left running"
            time.sleep(0.05)
        assert httpx2.get(f"{server.url}/health").status_code == 200
        after = scrape(server.url)
    bm = engine.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks

    completed = 0
    for request, result in zip(requests, results):
        events = result["events"]
        if request["leave_after"] is not None:
            assert len(events) == request["leave_after"]
            continue
        completed += 1
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        token_chunks = [c for c in chunks if c["choices"]]
        assert len(token_chunks) == request["max_tokens"]  # one event per token
        assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == request["max_tokens"]
        assert chunks[-1]["usage"]["prompt_tokens"] == len(request["prompt"])

    def delta(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0)

    assert delta("vllm:request_success_total", (("finished_reason", "length"),)) == completed
    assert delta("vllm:request_success_total", (("finished_reason", "abort"),)) == len(leavers)
    assert delta("vllm:prompt_tokens_total") == sum(len(r["prompt"]) for r in requests)
    assert delta("vllm:time_to_first_token_seconds_count") == NUM_REQUESTS
    assert delta("vllm:e2e_request_latency_seconds_count") == NUM_REQUESTS
    completed_tokens = sum(r["max_tokens"] for r in requests if r["leave_after"] is None)
    leaver_tokens = delta("vllm:generation_tokens_total") - completed_tokens
    # Each leaver generated at least what it read, and far fewer than it asked for: aborted at once.
    assert sum(r["leave_after"] for r in leavers) <= leaver_tokens < len(leavers) * LEAVER_MAX_TOKENS / 4
    assert after[("vllm:num_requests_running", ())] == 0 and after[("vllm:kv_cache_usage_perc", ())] == 0
    print(f"{NUM_REQUESTS} requests in {elapsed:.1f} s; preemptions {delta('vllm:num_preemptions_total'):.0f}, "
          f"mixed steps {delta('vllm:num_mixed_steps_total'):.0f} of {delta('vllm:num_steps_total'):.0f}")
