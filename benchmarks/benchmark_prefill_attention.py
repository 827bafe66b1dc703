"""Prefill attention of one chunk after cached context: the C kernel against the torch path.

One bf16 prefill chunk (default: 512 queries after 1536 cached keys, SmolLM2-135M's 9 query and
3 KV heads of 64 dims, block size 128) attended by the backend's two CPU paths, alternated in
one process: the C kernel that reads the paged cache in place (cpu_paged_prefill.c: AMX tiles
where the CPU has them, else AVX512-BF16, else float32 FMAs on AVX2; `--copy` picks one) and
the grouped torch path it replaces (gather of the context blocks, two flash-attention calls, a
log-sum-exp merge). Each is reported as milliseconds (median and best of the rounds), TFLOP/s
(4 x head_dim x heads x the causal query-key pairs) and the fraction of this machine's matmul
peak, measured in the same run (torch.matmul 2048^3, in bf16 where the CPU has bf16 dot
products, else in float32: roofline.matmul_peak_dtype).

    PYTHONPATH=$PWD python benchmarks/benchmark_prefill_attention.py \
        [--output-json benchmarks/results/prefill_attention.json]
"""

import argparse
import os
import statistics
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # the helper modules beside it, vllm of this checkout

from result_files import machine_info, write_json  # noqa: E402
from roofline import matmul_peak_dtype, measure_matmul_flops  # noqa: E402
from step_stats import mean_seconds  # noqa: E402
from vllm.attention.backends.abstract import SeqSpan  # noqa: E402
from vllm.attention.backends.cpu_attn import paged_attention  # noqa: E402
from vllm.attention.backends.cpu_metadata import build_attention_metadata  # noqa: E402
from vllm.attention.ops import cpu_paged_prefill  # noqa: E402
from vllm.core.block_manager import kv_slots  # noqa: E402
from vllm.platforms.cpu import cpu_flags  # noqa: E402

HEAD_DIM = 64


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=512)
    parser.add_argument("--context", type=int, default=1536, help="keys cached before the chunk")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the two paths")
    parser.add_argument("--repeats", type=int, default=5, help="calls per path and round")
    parser.add_argument("--copy", choices=["auto", "amx", "avx512"], default="auto",
                        help="the kernel's copy: auto = AMX where the CPU has it")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--output-json", type=str, default=None)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device("cpu"), torch.bfloat16
    if not cpu_paged_prefill.is_available(device, dtype, args.heads, args.kv_heads, HEAD_DIM, args.block_size):
        print("the prefill kernel is not available here (no C compiler, or neither AVX2 nor AVX512-BF16)",
              file=sys.stderr)
        return 1
    if args.copy != "auto" and cpu_paged_prefill.use_amx(args.copy == "amx") != (args.copy == "amx"):
        print("no AMX here", file=sys.stderr)
        return 1
    # --copy avx512 means the vector copy without AMX: AVX512-BF16's, or AVX2's where that is the widest
    vector = "avx512" if {"avx512_bf16", "avx512bw", "avx512dq"} <= cpu_flags() else "avx2"
    copy = "amx" if cpu_paged_prefill.use_amx(args.copy != "avx512") else vector

    torch.manual_seed(0)
    keys = args.context + args.queries
    num_blocks = -(-keys // args.block_size) + 1                      # the last one: the pad block
    table = torch.randperm(num_blocks - 1).tolist()                   # blocks in scrambled order
    key_cache = torch.randn(num_blocks, args.block_size, args.kv_heads, HEAD_DIM).to(dtype)
    value_cache = torch.randn_like(key_cache)
    spans = [SeqSpan(0, args.queries, args.context, table)]
    slots = kv_slots(table, range(args.context, keys), args.block_size)
    # The chunk's own keys and values, as the step wrote them to the cache.
    key = key_cache.view(-1, args.kv_heads, HEAD_DIM)[slots]          # (Q, KVH, D)
    value = value_cache.view(-1, args.kv_heads, HEAD_DIM)[slots]
    query = torch.randn(args.queries, args.heads, HEAD_DIM).to(dtype)  # (Q, H, D)
    scale = HEAD_DIM ** -0.5

    def metadata(paged_prefill: bool):
        return build_attention_metadata(spans, 0, slots, args.block_size, args.heads // args.kv_heads, None,
                                        num_blocks - 1, device, dtype, split_prefill=True,
                                        paged_prefill=paged_prefill)

    paths = {"kernel": metadata(True), "torch": metadata(False)}
    assert paths["kernel"].paged_prefills is not None and paths["torch"].groups
    outputs = {name: paged_attention(query, key, value, key_cache, value_cache, meta, scale)
               for name, meta in paths.items()}
    max_difference = (outputs["kernel"].float() - outputs["torch"].float()).abs().max().item()

    peak_dtype = matmul_peak_dtype("bfloat16")
    peak = measure_matmul_flops(peak_dtype)["flops_per_s"]
    flops = 4 * HEAD_DIM * args.heads * sum(args.context + i + 1 for i in range(args.queries))
    seconds = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, meta in paths.items():
            seconds[name].append(mean_seconds(
                lambda: paged_attention(query, key, value, key_cache, value_cache, meta, scale), args.repeats))
    peak = max(peak, measure_matmul_flops(peak_dtype)["flops_per_s"])  # before and after: the better

    results = {}
    for name, times in seconds.items():
        median = statistics.median(times)
        results[name] = {"ms_median": 1e3 * median, "ms_best": 1e3 * min(times), "ms_rounds": [1e3 * t for t in times],
                         "tflops_median": flops / median / 1e12, "fraction_of_matmul_peak": flops / median / peak}
        print(f"{name:7s} {1e3 * median:8.2f} ms median ({1e3 * min(times):.2f} best)  "
              f"{flops / median / 1e12:.3f} TFLOP/s = {flops / median / peak:.2f} of the matmul peak")
    speedup = statistics.median(seconds["torch"]) / statistics.median(seconds["kernel"])
    print(f"kernel copy {copy}: {speedup:.2f}x the torch path; {peak_dtype} matmul peak {peak / 1e12:.3f} TFLOP/s; "
          f"largest difference {max_difference:.4f}")
    if args.output_json:
        write_json({"args": vars(args), "kernel_copy": copy, "flops": flops, "matmul_peak_flops_per_s": peak,
                    "matmul_peak_dtype": peak_dtype,
                    "paths": results, "kernel_speedup_over_torch": speedup,
                    "max_abs_difference": max_difference, "machine": machine_info()}, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
