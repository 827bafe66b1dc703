"""How many graphs Gaudi compiles at warm-up: this engine's HPU design beside two bucket grids.

    this engine        graphs per region, each keyed by one or two bucket sizes
                       (vllm/attention/backends/hpu_attn.py): per token bucket T, the model body
                       (first, middle and last layer pieces) and the mixed-step combine, the
                       prefill part at every context bucket C (and without context), the decode
                       part at every block bucket NB a step of T tokens reaches, the logits of
                       the sampled rows and of all T rows; and the block copies. The counts come
                       from the `HpuBuckets` the backend warms (tests/test_hpu_path.py checks them
                       against what warm-up compiles).
    Habana fork        its documented linear defaults: prompt (batch size x sequence length) and
    (linear)           decode (batch size x KV blocks) grids, each bucket a whole-model graph:
                         prompt batch size    min 1,           step 32,          max max_num_seqs
                         prompt seq length    min block_size,  step block_size,  max max_model_len
                         decode batch size    min 1,           step 32,          max max_num_seqs
                         decode blocks        min block_size,  step block_size,
                                              max max_num_seqs * max_model_len / block_size
                       ranges ramp up by powers of two until `step`, then grow by `step`; prompt
                       buckets only where batch x length fits max_num_batched_tokens.
    vllm-gaudi         its exponential default with chunked prefill and prefix caching on (as in
    (exponential)      vLLM V1): prompt (batch size, query length, context blocks) and decode
                       (batch size, blocks) buckets, each a whole-model graph; ranges of
                       ceil(log2(max)) + 1 exponentially spaced sizes rounded up to their step.

The KV cache is taken to hold max_num_seqs sequences of max_model_len tokens.

    python benchmarks/habana_bucket_grid.py --output-json benchmarks/results/habana_bucket_grid.json
"""

import argparse
import itertools
import json
import math

from vllm.attention.backends.hpu_metadata import HpuBuckets
from vllm.platforms.hpu import HpuPlatform
from vllm.worker.bucketing import BucketConfig, generate_buckets

def ours(budget: int, max_model_len: int, block_size: int, max_num_seqs: int) -> dict:
    tokens = generate_buckets(BucketConfig(min=min(HpuPlatform.min_token_bucket, budget), step=128, max=budget))
    counts = HpuBuckets.from_limits(block_size, max_model_len, max_num_seqs, 1).graph_counts(tokens)
    return {"token_buckets": tokens, **counts, "total": sum(counts.values())}


def _linear_range(lo: int, step: int, hi: int) -> list[int]:
    values, v = [], lo
    while v < step and v <= hi:
        values.append(v)
        v *= 2
    return sorted({*values, *range(step, hi + 1, step)})


def habana_linear(budget: int, max_model_len: int, block_size: int, max_num_seqs: int) -> dict:
    prompt = [(bs, seq) for bs in _linear_range(1, 32, max_num_seqs)
              for seq in _linear_range(block_size, block_size, max_model_len) if bs * seq <= budget]
    max_blocks = max(block_size, max_num_seqs * max_model_len // block_size)
    decode = list(itertools.product(_linear_range(1, 32, max_num_seqs),
                                    _linear_range(block_size, block_size, max_blocks)))
    return {"prompt": len(prompt), "decode": len(decode), "total": len(prompt) + len(decode)}


def _exponential_range(lo: int, step: int, hi: int, count: int, long_context: bool = False) -> list[int]:
    """`count` sizes from lo to hi, exponentially spaced and rounded up to `step`; with
    `long_context`, half of them exponential up to hi / count and the rest linear."""
    if count == 1:
        return [hi]
    num_exp, top = (count // 2, hi / count) if long_context else (count, hi)
    values = {math.ceil(lo * (top / lo) ** (i / (num_exp - 1)) / step) * step for i in range(num_exp)}
    if long_context:
        num_linear = count - num_exp
        values |= {math.ceil((top + i * (hi - top) / num_linear) / step) * step for i in range(1, num_linear + 1)}
    return sorted(values)


def _limit(n: int) -> int:
    return math.ceil(math.log2(n)) + 1


def vllm_gaudi_exponential(budget: int, max_model_len: int, block_size: int, max_num_seqs: int) -> dict:
    num_blocks = max_num_seqs * math.ceil(max_model_len / block_size)
    prompt = []
    for bs in _exponential_range(1, 2, max_num_seqs, _limit(max_num_seqs)):
        for seq in _exponential_range(block_size, block_size, budget, _limit(budget), long_context=True):
            contexts = [0] + [math.ceil(num_blocks ** (i / _limit(num_blocks)))
                              for i in range(1, _limit(num_blocks) + 1)]
            exceeded = False
            for ctx in contexts:
                if seq > budget or ctx > num_blocks:
                    continue
                if seq + ctx * block_size > max_model_len:
                    if exceeded:
                        continue
                    exceeded = True  # the first bucket past max_model_len is kept
                prompt.append((bs, seq, ctx))
    max_decode = min(max_model_len // block_size * max_num_seqs, num_blocks)
    block_buckets = _exponential_range(1, max_num_seqs, max_decode, _limit(num_blocks))
    decode = []
    for bs in _exponential_range(1, 2, max_num_seqs, _limit(max_num_seqs)):
        reach = min(bs * math.ceil(max_model_len / block_size), num_blocks)
        fitting = [x for x in block_buckets if x <= reach]
        if fitting:
            decode += [(bs, x) for x in fitting if bs <= x]
    return {"prompt": len(set(prompt)), "decode": len(set(decode)), "total": len(set(prompt)) + len(set(decode))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--max-model-lens", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    rows = []
    print(f"{'budget':>6} {'max_model_len':>13} {'ours':>6} {'Habana linear':>14} {'vllm-gaudi exp':>15}")
    for budget, max_model_len in itertools.product(args.budgets, args.max_model_lens):
        dims = (budget, max_model_len, args.block_size, args.max_num_seqs)
        row = {"max_num_batched_tokens": budget, "max_model_len": max_model_len, "ours": ours(*dims),
               "habana_fork_linear": habana_linear(*dims), "vllm_gaudi_exponential": vllm_gaudi_exponential(*dims)}
        rows.append(row)
        print(f"{budget:>6} {max_model_len:>13} {row['ours']['total']:>6} {row['habana_fork_linear']['total']:>14} "
              f"{row['vllm_gaudi_exponential']['total']:>15}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"max_num_seqs": args.max_num_seqs, "block_size": args.block_size, "rows": rows}, f,
                      indent=2)


if __name__ == "__main__":
    main()
