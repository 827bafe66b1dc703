"""Workload F: requests that share a long system prompt, with prefix caching on and off, in one run.

    F  64 requests arriving together, each a shared 1,536-token system prompt plus 64 tokens of
       its own, 64 outputs each. Time to first token (P50, P99; queueing included: they all
       arrive at once) and total tokens/s (prompt + output tokens over the wall time), caching
       on against off, and the prefix cache hit rate (tokens found / tokens looked up).

Each mode runs in a fresh engine after a short warm-up on unrelated prompts (whose blocks are
then dropped with `reset_prefix_cache`), so the first request of the workload finds nothing.
Prompts are random token ids, outputs greedy with exactly the requested length (ignore_eos).
`--scale` shrinks every length (for smoke tests).

    python benchmarks/benchmark_prefix_caching.py --output-json benchmarks/results/prefix_caching.json
"""

import argparse
import random
import time

import result_files
import engine_setup
import workload_prompts
import step_stats


def _size(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def run_mode(args: argparse.Namespace, caching: bool, prompts: list[list[int]], output_len: int,
             warmup: list[list[int]]) -> dict:
    from vllm import SamplingParams
    llm, init_s = engine_setup.build_llm(args, enable_prefix_caching=caching)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in warmup], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.reset_prefix_cache()
    before = step_stats.stats_snapshot(engine)
    hits0, queries0 = engine.stats.num_prefix_cache_hits, engine.stats.num_prefix_cache_queries
    first_token: dict[str, float] = {}
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"f{i}", {"prompt_token_ids": p}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in first_token:
                first_token[out.request_id] = time.perf_counter() - start
    wall = time.perf_counter() - start
    assert len(first_token) == len(prompts)
    tokens = sum(map(len, prompts)) + len(prompts) * output_len
    ttft = step_stats.percentiles(first_token.values(), ps=(50, 99))
    hits = engine.stats.num_prefix_cache_hits - hits0
    queries = engine.stats.num_prefix_cache_queries - queries0
    return {
        "ttft_p50_s": ttft["50"], "ttft_p99_s": ttft["99"], "wall_s": wall,
        "total_tokens_per_s": tokens / wall,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "prefix_cache_hits": hits, "prefix_cache_queries": queries,
        "engine_stats": step_stats.stats_diff(before, step_stats.stats_snapshot(engine)),
        "init_s": init_s,
    }


def run(args: argparse.Namespace) -> dict:
    engine_setup.apply_threads(args)
    s = args.scale
    rng = random.Random(args.seed)
    tokenizer = engine_setup.load_hf_tokenizer(args.model, args.tokenizer)
    vocab, special = workload_prompts.tokenizer_vocab(tokenizer)
    system = workload_prompts.random_token_ids(rng, _size(args.prefix_len, s), vocab, special)
    prompts = [system + workload_prompts.random_token_ids(rng, _size(args.suffix_len, s), vocab, special)
               for _ in range(args.num_requests)]
    warmup = [workload_prompts.random_token_ids(rng, _size(args.suffix_len, s), vocab, special)
              for _ in range(2)]
    output_len = _size(args.output_len, s)
    modes = {}
    for caching in (False, True):
        name = "caching_on" if caching else "caching_off"
        result_files.log(f"F: {name}")
        modes[name] = run_mode(args, caching, prompts, output_len, warmup)
    off, on = modes["caching_off"], modes["caching_on"]
    return {
        "definition": __doc__.split("\n\n")[1],
        "workload": {"num_requests": len(prompts), "shared_prefix_len": len(system),
                     "own_len": len(prompts[0]) - len(system), "output_len": output_len},
        "modes": modes,
        "ratios": {
            "ttft_p50_off_over_on": off["ttft_p50_s"] / on["ttft_p50_s"],
            "ttft_p99_off_over_on": off["ttft_p99_s"] / on["ttft_p99_s"],
            "throughput_on_over_off": on["total_tokens_per_s"] / off["total_tokens_per_s"],
        },
        "machine": result_files.machine_info(),
        "args": result_files.args_dict(args),
    }


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1536, help="tokens of the shared system prompt")
    parser.add_argument("--suffix-len", type=int, default=64, help="tokens of each request's own")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every length")
    parser.add_argument("--output-json", default=None, help="write the results here (without it, only print them)")
    engine_setup.add_engine_args(parser)
    return parser


def main() -> None:
    args = make_parser().parse_args()
    result = run(args)
    for name, m in result["modes"].items():
        print(f"{name}: TTFT P50 {m['ttft_p50_s']:.3f} s, P99 {m['ttft_p99_s']:.3f} s, "
              f"{m['total_tokens_per_s']:.1f} total tokens/s, hit rate {m['prefix_cache_hit_rate']:.3f}")
    for k, v in result["ratios"].items():
        print(f"{k}: {v:.2f}")
    if args.output_json:
        print(f"Results written to {result_files.write_json(result, args.output_json)}")


if __name__ == "__main__":
    main()
