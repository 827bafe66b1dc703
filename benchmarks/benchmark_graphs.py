"""Graph capture versus eager, same workloads, one run: warm-up cost and the speed it buys.

For each mode (eager, graphs) it builds an engine with the given config and measures:
  * warm-up: graphs captured and seconds (graph mode), compiles after warm-up (must be 0);
  * decode: tokens/s of --decode-batch sequences decoding together (after their prefill). On a
    CPU with the C kernels, steps of only decodes run each layer as one C call in both modes (no
    graph), so the two modes differ there only by noise;
  * prefill: tokens/s of one --prefill-len prompt, chunked at the step budget (eager: the C
    layers where they take the step; graphs: the captured torch layers);
  * padding overhead of the bucketed steps.

    python benchmarks/benchmark_graphs.py                      # default config, SmolLM2-135M bf16
    python benchmarks/benchmark_graphs.py --output-json benchmarks/results/graphs.json
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

from vllm import LLM, SamplingParams


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def _drain(engine) -> int:
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps


def measure(args: argparse.Namespace, enforce_eager: bool) -> dict:
    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              block_size=args.block_size, enforce_eager=enforce_eager)
    init_seconds = time.perf_counter() - start
    engine = llm.llm_engine
    result: dict = {"mode": "eager" if enforce_eager else "graphs", "init_seconds": init_seconds}

    for batch in args.decode_batch:
        # Prefill first (not timed), then time pure decode steps.
        params = SamplingParams(temperature=0, max_tokens=args.decode_tokens + 1, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"d{batch}-{i}", {"prompt_token_ids": _prompt(args.decode_prompt_len, i)}, params)
        while any(g.first.num_computed_tokens < g.first.num_prompt_tokens for g in engine.requests.values()):
            engine.step()
        t = time.perf_counter()
        steps = _drain(engine)
        elapsed = time.perf_counter() - t
        result[f"decode_batch{batch}_tokens_per_s"] = batch * steps / elapsed
        result[f"decode_batch{batch}_step_ms"] = 1000 * elapsed / steps

    times = []
    for rep in range(args.prefill_reps):
        engine.add_request(f"p{rep}", {"prompt_token_ids": _prompt(args.prefill_len, 100 + rep)},
                           SamplingParams(temperature=0, max_tokens=1))
        t = time.perf_counter()
        _drain(engine)
        times.append(time.perf_counter() - t)
    result["prefill_len"] = args.prefill_len
    result["prefill_seconds"] = min(times)
    result["prefill_tokens_per_s"] = args.prefill_len / min(times)

    stats = engine.graph_stats
    result.update(buckets=stats.buckets, graphs_compiled_at_warmup=stats.graphs_compiled_at_warmup,
                  warmup_seconds=stats.warmup_seconds, compiles_after_warmup=stats.compiles_after_warmup,
                  unwarmed_steps=stats.unwarmed_steps, eager_steps=stats.eager_steps,
                  padding_overhead=stats.padding_overhead)
    return result


_RESULT_MARK = "MODE_RESULT "


def _measure_in_child(args: argparse.Namespace, mode: str) -> dict:
    """Measures one mode in a fresh process, so one engine's leftovers (allocator state, compile
    workers, packed weights) cannot slow the other."""
    argv = [sys.executable, __file__, "--mode", mode]
    for name, value in vars(args).items():
        if name in ("mode", "output_json") or value is None:
            continue
        argv.append("--" + name.replace("_", "-"))
        argv.extend(str(v) for v in (value if isinstance(value, list) else [value]))
    out = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True).stdout
    line = next(x for x in out.splitlines() if x.startswith(_RESULT_MARK))
    return json.loads(line[len(_RESULT_MARK):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--decode-batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--decode-prompt-len", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=2000)
    p.add_argument("--prefill-reps", type=int, default=2)
    p.add_argument("--output-json", default=None)
    p.add_argument("--mode", choices=["eager", "graphs"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.mode is not None:  # the child process of one mode
        print(_RESULT_MARK + json.dumps(measure(args, enforce_eager=args.mode == "eager")))
        return
    eager, graphs = _measure_in_child(args, "eager"), _measure_in_child(args, "graphs")
    speedup = {k: graphs[k] / eager[k] for k in eager if k.endswith("tokens_per_s")}
    result = {"config": vars(args), "eager": eager, "graphs": graphs, "graphs_over_eager": speedup,
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "torch": torch.__version__, "threads": torch.get_num_threads()}}
    print(json.dumps({"graphs_over_eager": speedup, "graphs": graphs["graphs_compiled_at_warmup"],
                      "warmup_seconds": round(graphs["warmup_seconds"], 1),
                      "compiles_after_warmup": graphs["compiles_after_warmup"]}, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
