"""How many graphs the Habana fork's default bucketing would need, next to ours, for one config.

The Habana fork buckets prompts on a (batch size x sequence length) grid and decodes on a
(batch size x KV blocks) grid. Its documented linear defaults, used here:

    prompt batch size    min 1,           step 32,          max max_num_prefill_seqs (= max_num_seqs)
    prompt seq length    min block_size,  step block_size,  max max_model_len
    decode batch size    min 1,           step 32,          max max_num_seqs
    decode blocks        min block_size,  step block_size,  max max_num_seqs * max_model_len / block_size

Each range ramps up by powers of two from min until it reaches step, then grows linearly by step;
prompt buckets are kept only when batch x length fits in max_num_batched_tokens.

    python benchmarks/habana_bucket_grid.py --max-num-batched-tokens 512 --max-num-seqs 64 \
        --max-model-len 2048 --block-size 128
"""

import argparse
import json

from vllm.worker.bucketing import BucketConfig, generate_buckets


def habana_range(lo: int, step: int, hi: int) -> list[int]:
    values = []
    v = lo
    while v < step and v <= hi:
        values.append(v)
        v *= 2
    values += list(range(step, hi + 1, step))
    return sorted(set(values))


def habana_grid(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                block_size: int) -> dict:
    prompt = [(bs, seq) for bs in habana_range(1, 32, max_num_seqs)
              for seq in habana_range(block_size, block_size, max_model_len)
              if bs * seq <= max_num_batched_tokens]
    max_blocks = max(block_size, max_num_seqs * max_model_len // block_size)
    decode = [(bs, blocks) for bs in habana_range(1, 32, max_num_seqs)
              for blocks in habana_range(block_size, block_size, max_blocks)]
    return {"prompt_buckets": len(prompt), "decode_buckets": len(decode),
            "total": len(prompt) + len(decode)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    habana = habana_grid(args.max_num_batched_tokens, args.max_num_seqs, args.max_model_len, args.block_size)
    ours = generate_buckets(BucketConfig(min=min(16, args.max_num_batched_tokens), step=128,
                                         max=args.max_num_batched_tokens))
    result = {"config": vars(args), "habana_fork_default": habana,
              "ours": {"token_buckets": ours, "buckets": len(ours), "hpu_graphs": len(ours)}}
    print(f"Habana fork default grid: {habana['prompt_buckets']} prompt + {habana['decode_buckets']} "
          f"decode = {habana['total']} buckets")
    print(f"this engine: {len(ours)} token buckets {ours} -> {len(ours)} whole-model graphs on HPU "
          "(one per bucket); on CPU, with buckets from 2, one graph with a symbolic token count "
          "serves them all")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
