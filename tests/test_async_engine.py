"""AsyncLLMEngine: concurrent streams share steps, match offline generation, and abort cleanly.

The first tests use a fake engine (fast, and it records whether a step ever overlapped an add
or an abort); the rest run the tiny Llama end to end against `LLM.generate`.
"""

import asyncio
import math
import random
import threading
import time

import pytest

from tests.utils import random_prompts
from vllm import LLM, AsyncLLMEngine, CompletionOutput, RequestOutput, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm_engine import AsyncEngineDeadError
from vllm.engine.llm_engine import LLMEngine

TIMEOUT_S = 60.0  # a hang fails the test instead of stalling the suite


def run(coro):
    async def bounded():
        return await asyncio.wait_for(coro, TIMEOUT_S)
    return asyncio.run(bounded())


async def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------- with a fake engine

class FakeEngine:
    """Gives every request one token per step (token i is i) until max_tokens.

    `overlaps` counts adds and aborts that arrived while a step was running in its thread.
    """

    def __init__(self, step_seconds: float = 0.01, fail_at_step: int | None = None) -> None:
        self.tokenizer = "fake-tokenizer"
        self.step_seconds = step_seconds
        self.fail_at_step = fail_at_step
        self.requests: dict[str, tuple[int, list[int]]] = {}
        self.busy = False
        self.overlaps = 0
        self.num_steps = 0
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0) -> None:
        self.overlaps += self.busy
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.requests[request_id] = (params.max_tokens, [])

    def abort_request(self, request_id) -> None:
        self.overlaps += self.busy
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.busy = True
        try:
            time.sleep(self.step_seconds)
            self.num_steps += 1
            if self.num_steps == self.fail_at_step:
                raise RuntimeError("boom")
            outputs = []
            for rid, (max_tokens, tokens) in list(self.requests.items()):
                tokens.append(len(tokens))
                done = len(tokens) >= max_tokens
                outputs.append(RequestOutput(rid, None, [0], [CompletionOutput(0, "", list(tokens))], done))
                if done:
                    del self.requests[rid]
            return outputs
        finally:
            self.busy = False


def test_steps_run_off_the_event_loop_and_never_overlap_adds_or_aborts():
    fake = FakeEngine(step_seconds=0.01)
    aengine = AsyncLLMEngine(fake)
    rng = random.Random(0)

    async def consume(i: int) -> int:
        await asyncio.sleep(rng.uniform(0, 0.05))  # staggered arrivals land between steps
        count = 0
        async for _ in aengine.generate("p", SamplingParams(max_tokens=10), f"r{i}"):
            count += 1
            if i % 3 == 0 and count == 4:
                await asyncio.sleep(0.03)  # outputs queue up meanwhile; the abort drops them
                await aengine.abort(f"r{i}")
            if i % 3 == 1 and count == 5:
                break
        return count

    async def ticker(stop: asyncio.Event) -> int:
        ticks = 0
        while not stop.is_set():
            await asyncio.sleep(0.002)
            ticks += 1
        return ticks

    async def main():
        stop = asyncio.Event()
        tick_task = asyncio.create_task(ticker(stop))
        counts = await asyncio.gather(*(consume(i) for i in range(30)))
        await wait_until(lambda: aengine.num_unfinished_requests == 0)
        stop.set()
        ticks = await tick_task
        await aengine.shutdown()
        return counts, ticks

    counts, ticks = run(main())
    assert counts == [4 if i % 3 == 0 else 5 if i % 3 == 1 else 10 for i in range(30)]
    assert fake.overlaps == 0 and not fake.requests and not aengine.is_running
    assert sorted(fake.aborted) == sorted(f"r{i}" for i in range(30) if i % 3 != 2)  # break aborts too
    assert fake.num_steps < sum(counts) / 5  # the 30 streams advanced together
    # The event loop kept ticking during the steps: they ran in a worker thread.
    assert ticks > 2 * fake.num_steps


def test_a_failing_step_ends_every_stream_with_its_error():
    aengine = AsyncLLMEngine(FakeEngine(step_seconds=0.001, fail_at_step=3))

    async def consume(rid: str) -> BaseException | None:
        try:
            async for _ in aengine.generate("p", SamplingParams(max_tokens=10), rid):
                pass
        except RuntimeError as e:
            return e
        return None

    async def main():
        errors = await asyncio.gather(*(consume(f"r{i}") for i in range(3)))
        with pytest.raises(AsyncEngineDeadError):
            async for _ in aengine.generate("p", SamplingParams(max_tokens=1), "late"):
                pass
        assert not aengine.is_running  # a dead engine does not restart its loop
        return errors

    errors = run(main())
    assert [str(e) for e in errors] == ["boom"] * 3
    assert aengine.errored and not aengine.is_running and aengine.num_unfinished_requests == 0


# ---------------------------------------------------------------- with the tiny Llama

BUDGET = 32


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], dtype="float32", max_model_len=512, block_size=16,
               max_num_batched_tokens=BUDGET, enforce_eager=True)


def assert_engine_empty(llm: LLM) -> None:
    engine = llm.llm_engine
    bm = engine.scheduler.block_manager
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    assert bm.num_free_blocks == bm.num_blocks


def mixed_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 300] + [rng.randint(1, 300) for _ in range(n - 2)]
    return random_prompts(lengths, seed=seed)


def test_steps_run_on_the_thread_that_built_the_engine(tiny_checkpoints, monkeypatch):
    """from_engine_args loads the model on the step thread and every step runs there: the kernels'
    threads that the load and warm-up started are the only ones (see the class docstring)."""
    threads = {"build": set(), "step": set()}

    def record(name, method):
        def wrapper(*args, **kwargs):
            threads[name].add(threading.get_ident())
            return method(*args, **kwargs)
        return wrapper

    build = record("build", LLMEngine.from_engine_args.__func__)
    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(build))
    monkeypatch.setattr(LLMEngine, "step", record("step", LLMEngine.step))
    aengine = AsyncLLMEngine.from_engine_args(EngineArgs.from_kwargs(
        model=tiny_checkpoints["llama"], dtype="float32", max_model_len=128, block_size=16, enforce_eager=True,
        kv_cache_memory_bytes=16 * 2**20))

    async def main():
        async def consume(i):
            outs = [out async for out in aengine.generate(
                {"prompt_token_ids": random_prompts([5 + i], seed=i)[0]},
                SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), f"t{i}")]
            return outs[-1]
        outs = await asyncio.gather(*(consume(i) for i in range(4)))
        await aengine.shutdown()
        return outs

    outs = run(main())
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert len(threads["build"]) == 1 and threads["step"] == threads["build"]
    assert threading.get_ident() not in threads["step"]  # not the event loop's


def test_concurrent_streams_match_offline_and_share_steps(llm):
    prompts = mixed_prompts(20, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=1 + 7 * i % 30, ignore_eos=True) for i in range(20)]
    offline = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine = llm.llm_engine
    aengine = AsyncLLMEngine(engine)

    async def consume(i: int) -> list[RequestOutput]:
        stream = aengine.generate({"prompt_token_ids": prompts[i]}, params[i], f"s{i}")
        return [out async for out in stream]

    async def main():
        streams = await asyncio.gather(*(consume(i) for i in range(20)))
        await aengine.shutdown()
        return streams

    steps_before, mixed_before = engine.stats.num_steps, engine.stats.num_mixed_steps
    streams = run(main())
    steps = engine.stats.num_steps - steps_before
    for stream, ref in zip(streams, offline, strict=True):
        tokens = [out.outputs[0].token_ids for out in stream]
        assert len(tokens[0]) == 1  # nothing streamed before the prompt's last chunk
        assert all(len(b) == len(a) + 1 and b[:len(a)] == a for a, b in zip(tokens, tokens[1:]))
        assert [out.finished for out in stream] == [False] * (len(stream) - 1) + [True]
        assert tokens[-1] == ref.outputs[0].token_ids
        assert stream[-1].outputs[0].finish_reason == "length"
    # Served one at a time, each request would need at least its prefill chunks plus its decodes.
    one_at_a_time = sum(math.ceil(len(p) / BUDGET) + len(s) - 1 for p, s in zip(prompts, streams))
    assert steps < 0.5 * one_at_a_time, (steps, one_at_a_time)
    assert engine.stats.num_mixed_steps > mixed_before
    assert_engine_empty(llm)


def test_aborting_half_mid_stream_frees_every_block(llm):
    prompts = mixed_prompts(20, seed=2)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    aengine = AsyncLLMEngine(llm.llm_engine)

    async def consume(i: int) -> list[RequestOutput]:
        outs = []
        async for out in aengine.generate({"prompt_token_ids": prompts[i]}, params, f"a{i}"):
            outs.append(out)
            if i % 2 == 0 and len(outs) == 3:
                await aengine.abort(f"a{i}")  # the stream must end right here
        return outs

    async def main():
        streams = await asyncio.gather(*(consume(i) for i in range(20)))
        await aengine.shutdown()
        return streams

    streams = run(main())
    for i, outs in enumerate(streams):
        if i % 2 == 0:
            assert len(outs) == 3 and not outs[-1].finished
        else:
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 30
    assert_engine_empty(llm)


def test_consumer_that_breaks_or_is_cancelled_aborts_its_request(llm):
    long_prompt, other = random_prompts([200, 150], seed=3)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine = llm.llm_engine
    aengine = AsyncLLMEngine(engine)

    async def main():
        first = asyncio.Event()

        async def cancelled_consumer():
            async for _ in aengine.generate({"prompt_token_ids": other}, params, "cancel-me"):
                first.set()

        task = asyncio.create_task(cancelled_consumer())
        count = 0
        async for _ in aengine.generate({"prompt_token_ids": long_prompt}, params, "break-me"):
            count += 1
            if count == 2:
                break
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: aengine.num_unfinished_requests == 0)
        was_running = aengine.is_running
        await aengine.shutdown()
        return count, was_running

    steps_before = engine.stats.num_steps
    count, was_running = run(main())
    assert count == 2 and was_running and not aengine.is_running
    # Both stopped long before their 200 tokens: the prefills plus a few decodes at most.
    assert engine.stats.num_steps - steps_before < 60
    assert_engine_empty(llm)


def test_invalid_input_raises_in_the_caller_while_others_complete(llm):
    prompts = random_prompts([100, 40, 70], seed=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    aengine = AsyncLLMEngine(llm.llm_engine)

    async def main():
        started = asyncio.Event()

        async def consume(i: int) -> RequestOutput:
            async for out in aengine.generate({"prompt_token_ids": prompts[i]}, params, f"ok{i}"):  # noqa: B007
                started.set()
            return out

        tasks = [asyncio.create_task(consume(i)) for i in range(3)]
        await started.wait()
        bad = [({"prompt_token_ids": []}, params, "bad0", "empty"),
               ({"prompt_token_ids": [1]}, params, "ok0", "already in use"),
               ("hello", {"max_tokens": 3}, "bad1", "SamplingParams")]
        for prompt, p, rid, match in bad:
            with pytest.raises(ValueError, match=match):
                async for _ in aengine.generate(prompt, p, rid):
                    pass
        refused = [out async for out in aengine.generate({"prompt_token_ids": [5] * 600}, params, "big")]
        finals = await asyncio.gather(*tasks)
        await aengine.shutdown()
        return finals, refused

    finals, refused = run(main())
    assert all(out.finished and len(out.outputs[0].token_ids) == 12 for out in finals)
    assert len(refused) == 1 and refused[0].finished and "max_model_len" in refused[0].error
    assert_engine_empty(llm)
