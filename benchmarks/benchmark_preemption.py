"""Preemption in a tight KV cache: eight long requests where the cache holds two at a time.

--num-prompts prompts of about --input-len random token ids each generate --output-len greedy
tokens (ignore_eos) with block size 16 and a 256-token step budget, once in a cache of
--tight-blocks blocks (130: two 864-token requests at a time) and once in one with room for all
(--roomy-blocks). Reports, for each, the wall time of `LLM.generate` (after a warm-up call),
preemptions (total and per request), steps and computed tokens, and whether the two runs' tokens
are identical. The ratio of the wall times is the figure of interest: without thrash, the tight
cache costs only the decodes it cannot batch.

    python benchmarks/benchmark_preemption.py --save-result      # benchmarks/results/preemption.json
    python benchmarks/benchmark_preemption.py --model /path/to/tiny --dtype float32
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
import step_stats  # noqa: E402


def run(args: argparse.Namespace, num_blocks: int, prompts: list[dict],
        warm_up_prompt: dict) -> tuple[dict, list]:
    from vllm import SamplingParams

    # The cache must hold one request of max_model_len: 2048 fits the tight one's 2080 tokens.
    llm, _ = engine_setup.build_llm(args, block_size=16, max_num_batched_tokens=256,
                              num_gpu_blocks_override=num_blocks, max_model_len=args.max_model_len or 2048)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # A prompt of its own: one of the workload's would sit in the prefix cache, and the roomy
    # cache would keep all of it where the tight one evicts part, which is not the cost measured.
    llm.generate([warm_up_prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    before = step_stats.stats_snapshot(engine)
    preemptions = engine.stats.num_preemptions
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = step_stats.stats_diff(before, step_stats.stats_snapshot(engine))
    preempted = engine.stats.num_preemptions - preemptions
    result = {"num_blocks": num_blocks, "seconds": seconds, "preemptions": preempted,
              "preemptions_per_request": preempted / len(prompts), **stats}
    print(f"{num_blocks:5d} blocks: {seconds:7.2f} s, {preempted} preemptions, "
          f"{stats.get('num_steps')} steps")
    return result, [o.outputs[0].token_ids for o in outs]


def main(args: argparse.Namespace) -> dict:
    print(args)
    engine_setup.apply_threads(args)
    rng = random.Random(args.seed)
    tokenizer = engine_setup.load_hf_tokenizer(args.model, args.tokenizer)
    vocab, special = workload_prompts.tokenizer_vocab(tokenizer)
    prompts = [{"prompt_token_ids": workload_prompts.random_token_ids(rng, args.input_len + rng.randrange(8),
                                                                      vocab, special)}
               for _ in range(args.num_prompts + 1)]
    warm_up_prompt = prompts.pop()
    roomy, roomy_tokens = run(args, args.roomy_blocks, prompts, warm_up_prompt)
    tight, tight_tokens = run(args, args.tight_blocks, prompts, warm_up_prompt)
    results = {
        "args": result_files.args_dict(args),
        "machine": result_files.machine_info(),
        "roomy": roomy,
        "tight": tight,
        "wall_time_ratio": tight["seconds"] / roomy["seconds"],
        "outputs_identical": tight_tokens == roomy_tokens,
        # Identical where every kernel sums a token's outputs in one order whatever its step
        # holds (tests/test_batch_invariance.py): bf16 on AVX512-BF16 without AMX, and float32.
        # On AMX the GEMV of 1-4 decodes sums in another order than the tile GEMM of more, and a
        # request's bf16 tokens may part at a near tie.
        "requests_identical": sum(t == r for t, r in zip(tight_tokens, roomy_tokens)),
        "first_difference": [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), None)
                             for t, r in zip(tight_tokens, roomy_tokens)],
    }
    print(f"tight/roomy wall time: {results['wall_time_ratio']:.2f}x, preemptions per request "
          f"{tight['preemptions_per_request']:.2f}, outputs identical: {results['outputs_identical']} "
          f"({results['requests_identical']} of {len(prompts)} requests)")
    result_files.save_results(results, args.output_json, args.save_result, "preemption")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_setup.add_engine_args(parser)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=800, help="each prompt adds 0-7 tokens to it")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--tight-blocks", type=int, default=130)
    parser.add_argument("--roomy-blocks", type=int, default=1024)
    parser.add_argument("--output-json", type=str, default=None)
    parser.add_argument("--save-result", action="store_true")
    main(parser.parse_args())
