"""Latency of one batch, end to end, vLLM's benchmark shape.

Each iteration runs `LLM.generate` on --batch-size prompts of exactly --input-len random token
ids (seeded), each generating exactly --output-len tokens (ignore_eos, temperature 1.0 as in
vLLM), and times the whole call. --num-iters-warmup iterations run first and are not counted.
Prints vLLM's lines

    Avg latency: X seconds
    10% percentile latency: Y seconds      (also 25, 50, 75, 90, 99)

and, with --output-json PATH (or --save-result: benchmarks/results/<name>.json), vLLM's keys
avg_latency, latencies, percentiles plus the prefill/decode split of the measured iterations
(from per-step timings), machine info and a roofline section (prefill as a fraction of the
measured bf16 matmul peak, decode as a fraction of the measured memory bandwidth; roofline.py).

Defaults: vLLM's input/output/batch sizes (32/128/8); fewer iterations than vLLM's 10+30 so a
2-core CPU finishes in minutes.

    python benchmarks/benchmark_latency.py --input-len 32 --output-len 128 --batch-size 8
    python benchmarks/benchmark_latency.py --batch-size 1 --num-iters 10 --output-json /tmp/lat.json
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import result_files  # noqa: E402
import engine_setup  # noqa: E402
import workload_prompts  # noqa: E402
import roofline  # noqa: E402
import step_stats  # noqa: E402

PERCENTAGES = (10, 25, 50, 75, 90, 99)


def main(args: argparse.Namespace) -> dict:
    print(args)
    engine_setup.apply_threads(args)
    import numpy as np
    from vllm import SamplingParams

    llm, init_s = engine_setup.build_llm(args)
    engine = llm.llm_engine
    vocab, special = workload_prompts.tokenizer_vocab(llm.get_tokenizer())
    rng = random.Random(args.seed)
    prompts = [{"prompt_token_ids": workload_prompts.random_token_ids(rng, args.input_len, vocab, special)}
               for _ in range(args.batch_size)]
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, ignore_eos=True,
                            max_tokens=args.output_len)

    def run_once(recorder: step_stats.StepRecorder | None = None) -> float:
        start = time.perf_counter()
        if recorder is None:
            llm.generate(prompts, params, use_tqdm=False)
        else:
            recorder.generate(prompts, [params] * len(prompts))
        return time.perf_counter() - start

    print("Warming up...")
    for i in range(args.num_iters_warmup):
        result_files.log(f"warm-up iteration {i + 1}/{args.num_iters_warmup}: {run_once():.3f} s")

    latencies = []
    per_iter: list[dict] = []
    all_records: list[step_stats.StepRecord] = []
    before = step_stats.stats_snapshot(engine)
    for i in range(args.num_iters):
        recorder = step_stats.StepRecorder(engine)
        latency = run_once(recorder)
        latencies.append(latency)
        all_records += recorder.records
        pre = [r for r in recorder.records if r.prefill_tokens > 0]
        per_iter.append({"latency": latency, "steps": len(recorder.records),
                         "prefill_seconds": sum(r.seconds for r in pre),
                         "decode_seconds": sum(r.seconds for r in recorder.records
                                              if r.prefill_tokens == 0)})
        result_files.log(f"iteration {i + 1}/{args.num_iters}: {latency:.3f} s")
    stats = step_stats.stats_diff(before, step_stats.stats_snapshot(engine))

    latencies_arr = np.array(latencies)
    pct = step_stats.percentiles(latencies, PERCENTAGES)
    print(f"Avg latency: {np.mean(latencies_arr)} seconds")
    for p in PERCENTAGES:
        print(f"{p}% percentile latency: {pct[str(p)]} seconds")

    n = max(args.num_iters, 1)
    prefill_s = sum(it["prefill_seconds"] for it in per_iter) / n
    decode_s = sum(it["decode_seconds"] for it in per_iter) / n
    decode_steps = sum(1 for r in all_records if r.prefill_tokens == 0) / n
    print(f"Avg prefill (steps with prompt tokens): {prefill_s:.4f} s, "
          f"avg decode: {decode_s:.4f} s over {decode_steps:.0f} steps"
          + (f" ({1000 * decode_s / decode_steps:.2f} ms/step)" if decode_steps else ""))

    dtype = engine_setup.engine_dtype_name(llm, args)
    results = {
        "avg_latency": float(np.mean(latencies_arr)),
        "latencies": latencies,
        "percentiles": pct,
        "avg_prefill_latency": prefill_s,
        "avg_decode_latency": decode_s,
        "avg_decode_steps": decode_steps,
        "avg_decode_step_latency": decode_s / decode_steps if decode_steps else None,
        "iterations": per_iter,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "engine_init_seconds": init_s,
        "engine_stats": stats,
        "dtype": dtype,
        "model": engine_setup.resolve_model_path(args.model),
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "args": result_files.args_dict(args),
        "machine": result_files.machine_info(),
    }
    if not args.no_roofline:
        results["roofline"] = roofline.compute_roofline(
            args.model, dtype, all_records,
            fallback={"elapsed": sum(latencies), "prefill_tokens": stats["num_prefill_tokens"],
                      "decode_tokens": stats["num_decode_tokens"], "num_steps": stats["num_steps"]},
            weight_bytes=engine_setup.decode_weight_bytes(llm), min_seconds=args.roofline_seconds)
        roofline.print_roofline(results["roofline"])

    mode = "chunked" if args.enable_chunked_prefill else "unchunked"
    result_files.save_results(results, args.output_json, args.save_result,
                        f"latency-{mode}-in{args.input_len}-out{args.output_len}-bs{args.batch_size}")
    return results


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-iters-warmup", type=int, default=1,
                        help="iterations run before measuring (vLLM's default is 10)")
    parser.add_argument("--num-iters", type=int, default=5,
                        help="measured iterations (vLLM's default is 30)")
    parser.add_argument("--output-json", type=str, default=None,
                        help="write the latency results as JSON to this path")
    parser.add_argument("--save-result", action="store_true",
                        help="write the results to benchmarks/results/<name>.json")
    parser.add_argument("--no-roofline", action="store_true",
                        help="skip the matmul/bandwidth microbenchmarks and the roofline fractions")
    roofline.add_roofline_args(parser)
    engine_setup.add_engine_args(parser)
    return parser


if __name__ == "__main__":
    _parser = make_parser()
    _args = _parser.parse_args()
    for _name in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(_args, _name) < 1:
            _parser.error(f"--{_name.replace('_', '-')} must be at least 1")
    if _args.num_iters_warmup < 0:
        _parser.error("--num-iters-warmup must be >= 0")
    main(_args)
