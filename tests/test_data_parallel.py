"""Data parallelism: `vllm serve --data-parallel-size 2` answers every request with the greedy
text of one engine, from both replicas (Ray actors), sums their statistics and leaves no process
at shutdown; requests go to the least loaded replica first; a replica killed mid-run fails its
requests at once and the engine is dead."""

import asyncio
import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2
import pytest

from tests.test_serve_cli import free_port, start_server, stop_with_sigterm, wait_healthy
from tests.test_tensor_parallel import _wait_gone
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.engine.metrics_types import IterationStats, Stats

# Nodes join on the loopback address (see tests/test_ray_executor.py); read when ray is imported,
# here and in the `vllm serve` this test starts.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

ENGINE_KWARGS = dict(dtype="float32", max_model_len=256, block_size=16, max_num_batched_tokens=64,
                     max_num_seqs=8, kv_cache_memory_bytes=16 * 2**20)
PROMPTS = [f"Request {i}: " + "the quick brown fox " * (i % 4 + 1) for i in range(8)]
MAX_TOKENS = 8
# The engine flags tests/test_serve_cli.py's start_server gives `vllm serve`.
SERVE_KWARGS = dict(dtype="float32", max_model_len=1024, block_size=16, max_num_batched_tokens=64,
                    max_num_seqs=4, kv_cache_memory_bytes=32 * 2**20)


def test_merged_stats_sum_state_and_events():
    from vllm.engine.data_parallel import merge_stats

    def stats(running, waiting, usage, steps, tokens):
        return Stats(now=0.0, num_running=running, num_waiting=waiting, kv_cache_usage=usage,
                     num_steps=steps, num_mixed_steps=0, num_preemptions=0, num_prefix_cache_queries=0,
                     num_prefix_cache_hits=0,
                     iteration=IterationStats(num_generation_tokens=sum(tokens), step_num_tokens=tokens))

    # Replica 0 sent two Stats (the state is the latest's), replica 1 one.
    merged = merge_stats([[stats(5, 5, 0.9, 1, [3]), stats(1, 2, 0.5, 2, [4, 1])],
                          [stats(3, 0, 0.1, 1, [7])]], now=9.0)
    assert (merged.now, merged.num_running, merged.num_waiting) == (9.0, 4, 2)
    assert merged.kv_cache_usage == pytest.approx(0.3)
    assert merged.num_steps == 4
    assert merged.iteration.num_generation_tokens == 15
    assert merged.iteration.step_num_tokens == [3, 4, 1, 7]
    assert merge_stats([[stats(1, 0, 0.0, 1, [1])], []], now=1.0) is None


def test_vllm_serve_with_two_replicas_answers_every_request_with_dp1_text(tiny_checkpoints):
    want = LLM(tiny_checkpoints["llama"], **SERVE_KWARGS).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(tiny_checkpoints["llama"], port, "--data-parallel-size", "2")
    try:
        wait_healthy(proc, url)

        def complete(prompt: str) -> dict:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True}
            return httpx2.post(f"{url}/v1/completions", json=body, timeout=60).json()

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            responses = list(pool.map(complete, PROMPTS))
        metrics = httpx2.get(f"{url}/metrics").text
        time.sleep(1.0)  # the periodic statistics log the requests per replica
        output = stop_with_sigterm(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    for response, ref in zip(responses, want):
        assert response["choices"][0]["text"] == ref.outputs[0].text
        assert response["usage"]["completion_tokens"] == MAX_TOKENS
    # Both replicas served: the last count the server logged.
    routed = json.loads(re.findall(r"Data-parallel requests per replica: (\[[\d, ]+\])", output)[-1])
    assert sum(routed) == len(PROMPTS) and min(routed) > 0, routed
    # The replicas' statistics summed: every request's tokens and finish, whichever served it.
    success = re.search(r'vllm:request_success_total\{finished_reason="length",model_name="tiny"\} (\S+)', metrics)
    assert float(success.group(1)) == len(PROMPTS)
    generated = re.search(r'vllm:generation_tokens_total\{model_name="tiny"\} (\S+)', metrics)
    assert float(generated.group(1)) == len(PROMPTS) * MAX_TOKENS
    # Shut down with the server: no replica left.
    pids = [int(p) for p in re.findall(r"Data-parallel replica \d of 2: pid (\d+)", output)]
    assert len(pids) == 2 and _wait_gone(pids) == []


# The tests below share one pair of replicas in this process (the server above ran its own).
@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def dp_engine(local_ray, tiny_checkpoints):
    from vllm.engine.data_parallel import DataParallelEngine

    engine = DataParallelEngine.from_engine_args(
        AsyncEngineArgs(model=tiny_checkpoints["llama"], data_parallel_size=2, **ENGINE_KWARGS))
    yield engine
    asyncio.run(engine.shutdown())  # idempotent after the server's


def test_offline_llm_refuses_data_parallel(tiny_checkpoints):
    with pytest.raises(ValueError, match="data_parallel_size=2 .*vllm serve --data-parallel-size"):
        LLM(tiny_checkpoints["llama"], data_parallel_size=2, **ENGINE_KWARGS)


def test_requests_go_to_the_least_loaded_replica_lowest_index_first(dp_engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def run() -> list[list[int]]:
        counts = []
        start = list(dp_engine.requests_per_replica)
        streams = []
        for i in range(3):  # each held open after its first output
            stream = dp_engine.generate({"prompt_token_ids": [1, 2, 3 + i]}, params, f"lb-{i}")
            await anext(stream)
            streams.append(stream)
            counts.append([n - s for n, s in zip(dp_engine.requests_per_replica, start)])
        in_flight = list(dp_engine.in_flight)
        for stream in streams:
            await stream.aclose()  # aborts the request on its replica
        return counts, in_flight

    counts, in_flight = asyncio.run(run())
    # Both idle: replica 0; then the idle one; then a tie at one each: replica 0 again.
    assert counts == [[1, 0], [1, 1], [2, 1]]
    assert in_flight == [2, 1]
    assert dp_engine.in_flight == [0, 0]


def test_a_killed_replica_fails_its_requests_and_the_engine_is_dead(dp_engine):
    from vllm.engine.async_llm_engine import AsyncEngineDeadError

    engine = dp_engine
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def drain(stream) -> BaseException | None:
        try:
            async for _ in stream:
                pass
        except Exception as error:
            return error
        return None

    async def run() -> tuple[list[BaseException | None], float]:
        streams = [engine.generate({"prompt_token_ids": [1, 2, 3 + i]}, params, f"kill-{i}") for i in range(2)]
        for stream in streams:  # one on each replica, both running
            await anext(stream)
        os.kill(engine.replica_pids[1], signal.SIGKILL)
        start = time.monotonic()
        errors = await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), timeout=30)
        return errors, time.monotonic() - start

    errors, seconds = asyncio.run(run())
    assert seconds < 10
    assert errors[0] is None  # the live replica's request finished
    assert isinstance(errors[1], AsyncEngineDeadError) and "replica 1 died" in str(errors[1])
    assert engine.errored
    with pytest.raises(AsyncEngineDeadError):
        asyncio.run(anext(engine.generate({"prompt_token_ids": [1, 2]}, params, "after")))
    asyncio.run(engine.shutdown())
    assert _wait_gone(engine.replica_pids) == []
