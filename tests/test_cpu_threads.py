"""The CPU worker's thread count follows the load other processes put on the machine."""

import os
import subprocess
import sys
import time

import pytest
import torch

from vllm.platforms.cpu_threads import CpuTimes, ThreadGovernor, read_cpu_times, threads_for


@pytest.mark.parametrize("others, current, max_threads, want", [
    (0.0, 2, 2, 2),
    (0.39, 2, 2, 2),   # under the drop margin: keeps both
    (0.45, 2, 2, 1),
    (1.0, 2, 2, 1),
    (1.9, 2, 2, 1),    # never below one
    (0.35, 1, 2, 1),   # between the margins: keeps what it has
    (0.3, 1, 2, 2),
    (0.0, 1, 2, 2),
    (1.2, 4, 4, 3),
    (2.6, 4, 4, 1),
    (0.1, 1, 4, 4),
])
def test_threads_for_the_cores_left(others, current, max_threads, want):
    assert threads_for(others, current, max_threads) == want


class FakeClock:
    """CPU times advanced by hand: `others` and `own` are cores' worth over each step."""

    def __init__(self):
        self.times = CpuTimes(0.0, 0.0, 0.0)

    def advance(self, seconds, others, own):
        t = self.times
        self.times = CpuTimes(t.wall + seconds, t.busy + (others + own) * seconds, t.own + own * seconds)

    def __call__(self):
        return self.times

    def wall(self):
        return self.times.wall


def test_governor_drops_and_takes_back_a_thread_per_interval():
    clock, calls = FakeClock(), []
    governor = ThreadGovernor(2, calls.append, read_times=clock, interval_s=0.5, clock=clock.wall)
    governor.before_step()
    assert calls == [2]  # applied on the step thread at the first step
    clock.advance(0.3, others=1.0, own=1.0)
    governor.before_step()
    assert calls == [2]  # within the interval: not looked at yet
    clock.advance(0.3, others=1.0, own=1.0)
    governor.before_step()
    assert calls == [2, 1] and governor.threads == 1
    clock.advance(1.0, others=0.35, own=1.0)
    governor.before_step()
    assert calls == [2, 1]  # between the margins
    clock.advance(1.0, others=0.0, own=1.0)
    governor.before_step()
    assert calls == [2, 1, 2] and governor.threads == 2


@pytest.mark.parametrize("others_after, want", [(0.0, [2]), (1.0, [2, 1])])
def test_an_idle_interval_decides_nothing(others_after, want):
    """Others busy while the worker waited for requests: the count stays until an interval in
    which the worker ran shows what they do now."""
    clock, calls = FakeClock(), []
    governor = ThreadGovernor(2, calls.append, read_times=clock, interval_s=0.5, clock=clock.wall)
    governor.before_step()
    clock.advance(10.0, others=1.5, own=0.05)  # a pause between requests beside a busy job
    governor.before_step()
    assert calls == [2] and governor.threads == 2
    clock.advance(0.6, others=others_after, own=1.0)
    governor.before_step()
    assert calls == want


def test_a_worker_squeezed_by_busy_processes_still_decides():
    """Stepping beside several busy processes, the worker gets little of the machine, but enough
    to tell its intervals from waiting."""
    clock, calls = FakeClock(), []
    governor = ThreadGovernor(2, calls.append, read_times=clock, interval_s=0.5, clock=clock.wall)
    governor.before_step()
    clock.advance(0.6, others=1.8, own=0.2)
    governor.before_step()
    assert calls == [2, 1]


def test_governor_reads_the_cpu_times_once_an_interval():
    clock, reads = FakeClock(), []
    governor = ThreadGovernor(2, lambda n: None, read_times=lambda: (reads.append(1), clock())[1],
                              interval_s=0.5, clock=clock.wall)
    for _ in range(8):  # eight steps of 0.125 s: two intervals
        clock.advance(0.125, others=0.0, own=1.0)
        governor.before_step()
    assert len(reads) == 1 + 2  # at construction, then at the end of each interval


def test_governor_sets_the_count_on_each_new_step_thread():
    import threading

    calls = []
    governor = ThreadGovernor(2, calls.append, read_times=lambda: None)
    governor.before_step()
    governor.before_step()
    worker = threading.Thread(target=governor.before_step)
    worker.start()
    worker.join()
    assert calls == [2, 2]


def test_governor_warns_once_when_steps_leave_the_loading_thread(caplog):
    import threading

    governor = ThreadGovernor(2, lambda n: None, read_times=lambda: None)
    stepped, done = threading.Event(), threading.Event()

    def step_and_wait():  # alive until the end, so that the two threads' idents differ
        governor.before_step()
        stepped.set()
        done.wait()

    with caplog.at_level("WARNING", logger="vllm.platforms.cpu_threads"):
        governor.before_step()  # the thread that built it: nothing to say
        assert not caplog.records
        workers = [threading.Thread(target=step_and_wait) for _ in range(2)]
        for worker in workers:
            stepped.clear()
            worker.start()
            assert stepped.wait(10)
        done.set()
        for worker in workers:
            worker.join()
    assert len(caplog.records) == 1
    assert "another thread than the one that loaded the model" in caplog.records[0].getMessage()


def test_governor_without_proc_stat_keeps_its_threads():
    calls = []
    governor = ThreadGovernor(2, calls.append, read_times=lambda: None, interval_s=0.0)
    for _ in range(3):
        governor.before_step()
    assert calls == [2]


@pytest.mark.skipif(read_cpu_times() is None or (os.cpu_count() or 1) < 2, reason="needs /proc/stat and 2 cores")
def test_a_busy_process_counts_as_others_and_costs_a_thread():
    # Whatever else runs on the machine only adds to what the busy loop takes, so the bound
    # holds on a loaded machine too (where the loop gets less than its whole core).
    calls = []
    governor = ThreadGovernor(2, calls.append, interval_s=0.5)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # the interpreter starting up
        before = read_cpu_times()
        governor._last = before
        end = time.monotonic() + 1.0
        while time.monotonic() < end:  # this process at work meanwhile, as a worker running steps
            pass
        governor.before_step()
        after = read_cpu_times()
    finally:
        busy.kill()
        busy.wait()
    others = ((after.busy - before.busy) - (after.own - before.own)) / (after.wall - before.wall)
    assert others >= 0.5
    assert calls == [2, 1] and governor.threads == 1


@pytest.mark.skipif(read_cpu_times() is None, reason="needs /proc/stat")
def test_a_waited_for_child_counts_as_the_workers_own_time():
    # A C kernel built on first use: the compiler is a child the worker waits for.
    before = read_cpu_times()
    subprocess.run([sys.executable, "-c", "import time\nend = time.process_time() + 0.5\n"
                    "while time.process_time() < end: pass"], check=True)
    after = read_cpu_times()
    assert after.own - before.own >= 0.45


def test_the_cpu_worker_adapts_unless_the_user_fixed_the_count(monkeypatch, tiny_checkpoints):
    from vllm import LLM, SamplingParams

    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing to adapt")
    monkeypatch.setenv("VLLM_CPU_ADAPTIVE_THREADS", "1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", max_model_len=128, block_size=16,
              num_gpu_blocks_override=64)
    worker = llm.llm_engine.model_executor.worker
    assert worker.threads is not None and worker.threads.max_threads == torch.get_num_threads()
    # A step beside a fake load of one core runs on one thread, in the thread that runs steps.
    clock = FakeClock()
    worker.threads._read_times, worker.threads._clock, worker.threads._last = clock, clock.wall, clock()
    clock.advance(1.0, others=1.0, own=1.0)
    seen = []
    run = worker.runner.execute_model
    worker.runner.execute_model = lambda step, **kw: (seen.append(torch.get_num_threads()), run(step, **kw))[1]
    try:
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        worker.runner.execute_model = run
        torch.set_num_threads(worker.threads.max_threads)
    assert seen and seen[0] == 1
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    fixed = LLM(tiny_checkpoints["llama"], dtype="float32", max_model_len=128, block_size=16,
              num_gpu_blocks_override=64)
    assert fixed.llm_engine.model_executor.worker.threads is None


def test_graph_steps_run_eagerly_while_a_thread_is_given_up(monkeypatch, tiny_checkpoints):
    """Captured graphs hold the thread count they were captured at (dynamo guards it, and after
    warm-up nothing may compile): while the governor has dropped a thread, steps run eagerly,
    with the same tokens, and no step fails."""
    import torch._dynamo

    from vllm import LLM, SamplingParams

    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing to adapt")
    monkeypatch.setenv("VLLM_CPU_ADAPTIVE_THREADS", "1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch._dynamo.reset()
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", max_model_len=128, block_size=16,
              num_gpu_blocks_override=64, enforce_eager=False)
    engine, worker = llm.llm_engine, llm.llm_engine.model_executor.worker
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (3, 17, 40)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    eager_before = engine.graph_stats.eager_steps
    clock = FakeClock()
    worker.threads._read_times, worker.threads._clock, worker.threads._last = clock, clock.wall, clock()
    clock.advance(1.0, others=1.0, own=1.0)  # another process busy on a core: one thread given up
    try:
        llm.reset_prefix_cache()
        shared = llm.generate(prompts, params, use_tqdm=False)
    finally:
        torch.set_num_threads(worker.threads.max_threads)
    assert worker.threads.threads < worker.threads.max_threads
    assert [o.outputs[0].finish_reason for o in shared] == ["length"] * 3
    assert [o.outputs[0].token_ids for o in shared] == alone
    assert engine.graph_stats.eager_steps > eager_before
    assert engine.graph_stats.compiles_after_warmup == 0
