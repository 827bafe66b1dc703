"""Faults in a step: the step is taken back, its requests recompute it to the fault-free tokens
or end with an error, other requests are untouched, and the engine keeps serving.

Faults are injected into the tiny Llama at every kind of step (a decode, a prompt's first,
middle and last chunk, sampling, the step that forks n > 1 samples), once (transient) or every
time (persistent), through both `LLM.generate` and `AsyncLLMEngine`.
"""

import asyncio

import signal

import pytest

from tests.utils import random_prompts
from vllm import LLM, AsyncLLMEngine, SamplingParams
from vllm.engine.exceptions import EngineDeadError
from vllm.engine.interrupts import deferred_interrupts

BUDGET = 32
TARGET = 1  # the request faults are aimed at: a 100-token prompt, in chunks of at most 32


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], dtype="float32", max_model_len=256, block_size=16,
               max_num_batched_tokens=BUDGET, max_num_seqs=8, enforce_eager=True)


@pytest.fixture(autouse=True)
def _nothing_cached(request):
    """Each test starts with an empty prefix cache, so a prompt's first chunk starts at position
    0 (faults are aimed at chunks by where they start); within a test, caching stays on."""
    if "llm" in request.fixturenames:
        assert request.getfixturevalue("llm").reset_prefix_cache()


def requests() -> tuple[list[dict], list[SamplingParams]]:
    lengths = [20, 100, 7, 45, 60]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(lengths, seed=11)]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True) for _ in lengths]
    # Sampled n > 1, seeded: its samples are reproducible, so a recomputed one must match too.
    params[3] = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
    return prompts, params


def target_id(offset: int) -> str:
    """The engine id of request TARGET when a call's ids start at `offset`."""
    return str(offset + TARGET)


@pytest.fixture(scope="module")
def reference(llm):
    prompts, params = requests()
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def _of(sample_id: str, request_id: str) -> bool:
    """Whether `sample_id` is a sample of request `request_id` (itself, or "i_<id>" for n > 1)."""
    return sample_id == request_id or sample_id.endswith("_" + request_id)


def _is_kind(s, kind: str) -> bool:
    """Whether scheduled sequence `s` is the kind of share a fault is aimed at."""
    return {
        "decode": s.num_tokens == 1 and s.start_position > 100,
        "first_chunk": s.start_position == 0 and not s.sample,
        "middle_chunk": s.start_position > 0 and not s.sample,
        "last_chunk": s.start_position > 0 and s.sample and s.num_tokens > 1,
        "sampling": s.sample,
        "sampling_decode": s.sample and s.num_tokens == 1,
        "fork": bool(s.forks),
    }[kind]


class Fault:
    """Makes the steps that give the aimed-at request its `kind` of share fail, `times` times:
    in the middle of the forward pass (the second decoder layer raises after the first wrote its
    KV), or, for "sampling", in the sampler. Records the sample ids of each failed step."""

    def __init__(self, llm: LLM, kind: str, request_id: str, times: int) -> None:
        self.runner = llm.llm_engine.runner
        self.kind, self.request_id, self.times = kind, request_id, times
        self.failed_steps: list[set[str]] = []
        self._armed = False

    def _aimed(self, step) -> bool:
        return any(_of(s.request_id, self.request_id) and _is_kind(s, self.kind) for s in step.scheduled)

    def _raise(self, *args) -> None:
        if self._armed:
            self._armed = False
            raise RuntimeError(f"injected fault ({self.kind})")

    def __enter__(self) -> "Fault":
        runner, execute = self.runner, self.runner.execute_model

        def execute_model(step, **kwargs):
            self._armed = len(self.failed_steps) < self.times and self._aimed(step)
            if self._armed:
                self.failed_steps.append({s.request_id for s in step.scheduled})
            return execute(step, **kwargs)

        def sample(*args):
            sample_fn(*args)  # seeded generators have drawn: a retry must draw the same again
            self._raise()

        sample_fn = runner._sample
        self._patches = [(runner, "execute_model"), (runner, "_sample")]
        runner.execute_model = execute_model
        if self.kind.startswith("sampling"):
            runner._sample = sample
        else:
            self._hook = runner.model.model.layers[1].register_forward_pre_hook(lambda *a: self._raise())
        return self

    def __exit__(self, *exc) -> None:
        for obj, name in self._patches:
            obj.__dict__.pop(name, None)
        if not self.kind.startswith("sampling"):
            self._hook.remove()


def assert_engine_empty(llm: LLM) -> None:
    engine = llm.llm_engine
    bm = engine.scheduler.block_manager
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    assert bm.num_free_blocks == bm.num_blocks


def check_outcome(outs, reference, fault: Fault, offset: int) -> None:
    """Requests with a sample in MAX_FAILED_STEPS failed steps end with the error; every other
    request (retried or untouched) has exactly its fault-free tokens."""
    assert fault.failed_steps, "the fault never fired"
    for i, (out, ref) in enumerate(zip(outs, reference, strict=True)):
        rid = str(offset + i)
        samples = {sid for ids in fault.failed_steps for sid in ids if _of(sid, rid)}
        failures = max((sum(sid in ids for ids in fault.failed_steps) for sid in samples), default=0)
        if failures >= 2:
            assert out.finished and "injected fault" in out.error
            assert {c.finish_reason for c in out.outputs} <= {"error", "length"}
            assert "error" in {c.finish_reason for c in out.outputs}
        else:
            assert [c.token_ids for c in out.outputs] == ref, (i, fault.kind)
            assert out.error is None and all(c.finish_reason == "length" for c in out.outputs)


KINDS = ["decode", "first_chunk", "middle_chunk", "last_chunk", "sampling", "fork"]


def _target_for(kind: str) -> int:
    return 3 if kind == "fork" else TARGET  # request 3 is the n = 2 one


@pytest.mark.parametrize("times", [1, 2], ids=["transient", "persistent"])
@pytest.mark.parametrize("kind", KINDS)
def test_generate_recovers_from_a_fault_at_every_kind_of_step(llm, reference, kind, times, caplog):
    prompts, params = requests()
    offset = int(llm.generate("warm", SamplingParams(max_tokens=1), use_tqdm=False)[0].request_id) + 1
    with Fault(llm, kind, str(offset + _target_for(kind)), times) as fault:
        outs = llm.generate(prompts, params, use_tqdm=False)
    check_outcome(outs, reference, fault, offset)
    assert "taken back" in caplog.text
    assert_engine_empty(llm)
    if times == 1:
        assert all(o.error is None for o in outs)
        return
    assert outs[_target_for(kind)].outputs[0].finish_reason == "error"
    # The next call works and gives the fault-free tokens.
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in again] == reference
    assert_engine_empty(llm)


@pytest.mark.parametrize("kind", ["first_chunk", "decode", "fork"])
def test_async_streams_recover_from_a_fault(llm, reference, kind):
    prompts, params = requests()
    aengine = AsyncLLMEngine(llm.llm_engine)

    async def consume(i: int):
        outs = [out async for out in aengine.generate(prompts[i], params[i], f"{i}")]
        return outs[-1]

    async def main():
        outs = await asyncio.gather(*(consume(i) for i in range(len(prompts))))
        await aengine.shutdown()
        return outs

    with Fault(llm, kind, str(_target_for(kind)), times=2) as fault:
        outs = asyncio.run(asyncio.wait_for(main(), 60))
    check_outcome(outs, reference, fault, offset=0)
    assert outs[_target_for(kind)].outputs[0].finish_reason == "error"
    assert not aengine.errored
    assert_engine_empty(llm)


def test_a_hand_written_step_loop_gets_the_fault_free_tokens(llm, reference):
    """The loop of the issue: a fault in a long prompt's first chunk must not finish the request
    "normally" with tokens computed from a cache it never filled."""
    prompts, params = requests()
    engine = llm.llm_engine
    engine.add_request("loop", prompts[TARGET], params[TARGET])
    done = {}
    with Fault(llm, "first_chunk", "loop", times=1) as fault:
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert fault.failed_steps and engine.stats.num_failed_steps >= 1
    assert done["loop"].outputs[0].token_ids == reference[TARGET][0]
    assert_engine_empty(llm)


def test_interrupted_generate_leaves_the_engine_usable(llm, reference):
    prompts, params = requests()
    runner = llm.llm_engine.runner
    execute, calls = runner.execute_model, [0]

    def interrupted(step, **kwargs):
        calls[0] += 1
        if calls[0] == 4:
            raise KeyboardInterrupt
        return execute(step, **kwargs)

    runner.execute_model = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts * 12, params * 12, use_tqdm=False)
    finally:
        del runner.execute_model
    assert_engine_empty(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == reference


def test_an_interrupted_step_is_taken_back_and_the_loop_can_go_on(llm, reference):
    prompts, params = requests()
    engine = llm.llm_engine
    runner = engine.runner
    execute, calls = runner.execute_model, [0]

    def interrupted(step, **kwargs):
        calls[0] += 1
        if calls[0] in (2, 5):  # the middle of the prompt, then a decode
            raise KeyboardInterrupt
        return execute(step, **kwargs)

    engine.add_request("ctrl-c", prompts[TARGET], params[TARGET])
    done = {}
    runner.execute_model = interrupted
    try:
        while engine.has_unfinished_requests():
            try:
                done.update((o.request_id, o) for o in engine.step() if o.finished)
            except KeyboardInterrupt:
                pass
    finally:
        del runner.execute_model
    assert calls[0] > 5
    assert done["ctrl-c"].outputs[0].token_ids == reference[TARGET][0]
    assert_engine_empty(llm)


def test_an_error_outside_the_forward_pass_makes_the_engine_dead(tiny_checkpoints):
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", max_model_len=128, block_size=16,
              max_num_batched_tokens=BUDGET, enforce_eager=True)
    engine = llm.llm_engine

    def broken(*args):
        raise RuntimeError("bookkeeping bug")

    engine._process = broken
    with pytest.raises(EngineDeadError, match="bookkeeping bug"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert engine.is_dead
    # Every later call says so, never an AssertionError of a half-updated state.
    with pytest.raises(EngineDeadError):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(EngineDeadError):
        engine.step()
    engine.abort_request("0")  # a no-op


def test_bad_request_in_a_batch_queues_nothing(llm, reference):
    prompts, params = requests()
    bad = [SamplingParams(max_tokens=1)] * 2 + [SamplingParams(logprobs=1000)] + [SamplingParams()] * 2
    with pytest.raises(ValueError, match="logprobs=1000 exceeds max_logprobs"):
        llm.generate(["a", "b", "c", "d", "e"], bad, use_tqdm=False)
    assert_engine_empty(llm)
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=1), {"max_tokens": 1}], use_tqdm=False)
    assert_engine_empty(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == reference


@pytest.mark.parametrize("kind", ["sampling", "sampling_decode"])  # first token, a later one
def test_seeded_sampling_is_unchanged_by_a_fault_in_the_sampler(llm, kind):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": random_prompts([40], seed=4)[0]}
    want = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    offset = int(llm.generate("warm", SamplingParams(max_tokens=1), use_tqdm=False)[0].request_id) + 1
    with Fault(llm, kind, str(offset), times=1) as fault:
        got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert fault.failed_steps and got == want


def test_ctrl_c_inside_a_state_change_arrives_when_it_ends():
    # Under Python's own handler, whatever a test before this one in the process left in place.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        reached = []
        with pytest.raises(KeyboardInterrupt), deferred_interrupts():
            signal.raise_signal(signal.SIGINT)
            reached.append("after the signal")
        assert reached == ["after the signal"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
