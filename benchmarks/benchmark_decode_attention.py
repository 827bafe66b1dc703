"""Decode attention of one step over all layers: the C kernel against the memory it reads.

One bf16 decode step (default: workload D's decodes, 4 sequences with 2050 cached keys beside 16
with 60, SmolLM2-135M's 30 layers of 9 query and 3 KV heads of 64 dims, block size 128) on the C
decode kernel (cpu_paged_decode.c: AMX where the CPU has it, else AVX512-BF16, else AVX2;
`--copy` picks one), or with `--dtype float32` a float32 step as float32 models take (AVX2's
copy where that is the widest ISA, else the plain loop), in two placements of the cache:
  cold   every layer's blocks its own, scrambled: the step reads its keys and values from memory,
         as a real step does once the cache outgrows the last-level cache;
  warm   every layer on the first layer's blocks: after the first layer they are in the cache,
         so the time is the kernel's arithmetic.
Each is reported as milliseconds per step (median and best of the rounds) and GB/s of keys and
values read, cold also as the fraction of this machine's read bandwidth, measured in the same
run (roofline.measure_memory_bandwidth, before and after: the higher).

    PYTHONPATH=$PWD python benchmarks/benchmark_decode_attention.py \
        [--output-json benchmarks/results/decode_attention.json]
"""

import argparse
import os
import statistics
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # the helper modules beside it, vllm of this checkout

from result_files import machine_info, write_json  # noqa: E402
from roofline import add_roofline_args, measure_memory_bandwidth  # noqa: E402
from step_stats import mean_seconds  # noqa: E402
from vllm.attention.ops import cpu_paged_decode  # noqa: E402
from vllm.platforms.cpu import cpu_flags  # noqa: E402

HEAD_DIM = 64


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=str, default="2050x4,60x16",
                        help="keys per sequence, as LENxCOUNT groups separated by commas")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the two placements")
    parser.add_argument("--repeats", type=int, default=5, help="steps per placement and round")
    parser.add_argument("--copy", choices=["auto", "amx", "avx512"], default="auto",
                        help="the kernel's copy: auto = AMX where the CPU has it")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the cache's and the queries' dtype")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--output-json", type=str, default=None)
    add_roofline_args(parser)
    args = parser.parse_args()
    try:
        seq_lens = [int(length) for group in args.contexts.split(",")
                    for length, count in [group.split("x")] for _ in range(int(count))]
    except ValueError:
        parser.error(f"--contexts must be LENxCOUNT groups separated by commas, got {args.contexts!r}")
    if not seq_lens or min(seq_lens) < 1 or args.layers < 1:
        parser.error("--contexts needs at least one sequence of at least one key, and --layers at least 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device("cpu"), getattr(torch, args.dtype)
    if dtype == torch.float32 and args.copy == "amx":
        parser.error("--copy amx takes bf16 only: float32 decodes have no AMX copy")
    if not cpu_paged_decode.is_available(device, dtype, args.heads, args.kv_heads, HEAD_DIM):
        print("the decode kernel is not available here (no C compiler)", file=sys.stderr)
        return 1
    if args.copy != "auto" and cpu_paged_decode.use_amx(args.copy == "amx") != (args.copy == "amx"):
        print("no AMX here", file=sys.stderr)
        return 1
    # --copy avx512 means the vector copy without AMX: AVX512-BF16's, or AVX2's where that is the widest
    vector = "avx512" if {"avx512_bf16", "avx512bw"} <= cpu_flags() else "avx2"
    copy = "amx" if cpu_paged_decode.use_amx(args.copy != "avx512") else vector
    if dtype == torch.float32:  # float32 takes the AVX2 copy where that is the widest, else the plain loop
        copy = "avx2" if vector == "avx2" else "loop"

    torch.manual_seed(0)
    blocks = [-(-n // args.block_size) for n in seq_lens]             # per sequence
    num_blocks = sum(blocks) * args.layers
    key_cache = torch.randn(num_blocks, args.block_size, args.kv_heads, HEAD_DIM).to(dtype)
    value_cache = torch.randn_like(key_cache)
    order = torch.randperm(num_blocks)                                # blocks in scrambled order

    def block_tables(layer: int) -> torch.Tensor:                     # (S, max blocks) int64
        tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int64)
        at = layer * sum(blocks)
        for s, count in enumerate(blocks):
            tables[s, :count] = order[at:at + count]
            at += count
        return tables

    placements = {"cold": [block_tables(layer) for layer in range(args.layers)],
                  "warm": [block_tables(0)] * args.layers}
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    query = torch.randn(len(seq_lens), args.heads, HEAD_DIM).to(dtype)  # (S, H, D)
    out = torch.empty_like(query)
    scale = HEAD_DIM ** -0.5

    def step(tables: list[torch.Tensor]) -> None:
        for layer_tables in tables:
            cpu_paged_decode.paged_decode(query, key_cache, value_cache, layer_tables, lens, scale, None, out)

    bandwidth = measure_memory_bandwidth(min_seconds=args.roofline_seconds)["bytes_per_s"]
    seconds = {name: [] for name in placements}
    for _ in range(args.rounds):
        for name, tables in placements.items():
            seconds[name].append(mean_seconds(lambda: step(tables), args.repeats))
    bandwidth = max(bandwidth, measure_memory_bandwidth(min_seconds=args.roofline_seconds)["bytes_per_s"])

    read_bytes = sum(seq_lens) * args.layers * 2 * args.kv_heads * HEAD_DIM * dtype.itemsize  # keys and values
    results = {}
    for name, times in seconds.items():
        median = statistics.median(times)
        results[name] = {"ms_median": 1e3 * median, "ms_best": 1e3 * min(times), "ms_rounds": [1e3 * t for t in times],
                         "GB_per_s": read_bytes / median / 1e9}
        print(f"{name:5s} {1e3 * median:8.2f} ms median ({1e3 * min(times):.2f} best)  "
              f"{read_bytes / median / 1e9:6.1f} GB/s of keys and values")
    cold_fraction = read_bytes / statistics.median(seconds["cold"]) / bandwidth
    print(f"kernel copy {copy}: cold at {cold_fraction:.2f} of the read bandwidth ({bandwidth / 1e9:.1f} GB/s); "
          f"{read_bytes / 1e6:.1f} MB read per step")
    if args.output_json:
        write_json({"args": vars(args), "kernel_copy": copy, "read_bytes": read_bytes,
                    "dtype": args.dtype, "memory_bandwidth_bytes_per_s": bandwidth, "placements": results,
                    "cold_fraction_of_bandwidth": cold_fraction, "machine": machine_info()}, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
