"""The host's share of a decode step: scheduling it and preparing its inputs, without the model.

For each --num-seqs, that many requests of --input-len random tokens are prefilled through the
engine until all of them decode. Then, on that state, the step's host-side work is timed alone,
--repeats times each:
  schedule   Scheduler.schedule(), the step object for the runner (each one taken back with
             Scheduler.undo(), which is timed apart, so the state stays the same)
  prepare    the runner's prepare_inputs: the flat token tensors and the attention metadata
             the backend builds for the step (CPU: block tables, the kernels' columns, checks)
Reported in microseconds per step (median and best) and per sequence. On a device whose steps
take a few milliseconds, these costs set a floor under the step time however fast the device.

    PYTHONPATH=$PWD python benchmarks/benchmark_step_host.py [--num-seqs 1,16,64,256] \
        [--output-json benchmarks/results/step_host.json]
"""

import argparse
import os
import random
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # the helper modules beside it, vllm of this checkout

from engine_setup import add_engine_args, apply_threads, build_llm  # noqa: E402
from result_files import args_dict, machine_info, save_results  # noqa: E402


def _summary(times_us: list[float]) -> dict:
    return {"median_us": statistics.median(times_us), "best_us": min(times_us)}


def _call_us(fn):
    """(fn(), its microseconds)."""
    start = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - start) * 1e6


def measure(llm, num_seqs: int, input_len: int, repeats: int, rng: random.Random) -> dict:
    from vllm import SamplingParams

    engine = llm.llm_engine
    scheduler, runner = engine.scheduler, engine.runner
    vocab = len(llm.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    ids = [f"host-{num_seqs}-{i}" for i in range(num_seqs)]
    for request_id in ids:
        prompt = [rng.randrange(100, vocab) for _ in range(input_len)]
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    while len(scheduler.running) < num_seqs or any(s.is_prefill for s in scheduler.running):
        engine.step()
        if not engine.has_unfinished_requests():
            raise RuntimeError("the requests finished before they all decoded")

    times: dict[str, list[float]] = {"schedule": [], "undo": [], "prepare": []}
    for i in range(repeats + 1):  # the first round untimed: it warms caches
        step, schedule_us = _call_us(scheduler.schedule)
        assert step.num_decodes == num_seqs, f"{step.num_decodes} decodes scheduled of {num_seqs}"
        _, prepare_us = _call_us(lambda: runner.prepare_inputs(step, step.num_batched_tokens))
        _, undo_us = _call_us(lambda: scheduler.undo(step))
        if i:
            for name, us in (("schedule", schedule_us), ("undo", undo_us), ("prepare", prepare_us)):
                times[name].append(us)
    engine.abort_request(ids)
    result: dict = {name: _summary(values) for name, values in times.items()}
    result["num_seqs"] = num_seqs
    result["per_seq_us"] = {name: result[name]["median_us"] / num_seqs for name in ("schedule", "prepare")}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=str, default="1,16,64,256",
                        help="decoding sequences per step, comma-separated")
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens of each request")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per measure")
    parser.add_argument("--output-json", type=str, default=None)
    parser.add_argument("--save-result", action="store_true",
                        help="write benchmarks/results/step_host.json")
    add_engine_args(parser)  # its --seed also seeds the random prompts
    args = parser.parse_args()
    try:
        counts = [int(n) for n in args.num_seqs.split(",")]
    except ValueError:
        parser.error(f"--num-seqs must be integers separated by commas, got {args.num_seqs!r}")
    if not counts or min(counts) < 1 or args.input_len < 1 or args.repeats < 1:
        parser.error("--num-seqs, --input-len and --repeats must be at least 1")
    apply_threads(args)
    llm, _ = build_llm(args, max_num_seqs=max(max(counts), args.max_num_seqs or 0))
    rng = random.Random(args.seed or 0)
    results = [measure(llm, n, args.input_len, args.repeats, rng) for n in counts]
    for r in results:
        print(f"{r['num_seqs']:4d} sequences: schedule {r['schedule']['median_us']:8.1f} us, "
              f"undo {r['undo']['median_us']:7.1f} us, prepare {r['prepare']['median_us']:8.1f} us "
              f"({r['per_seq_us']['prepare']:.2f} us a sequence)")
    save_results({"results": results, "machine": machine_info(), "args": args_dict(args)},
                 args.output_json, args.save_result, "step_host")
    return 0


if __name__ == "__main__":
    sys.exit(main())
