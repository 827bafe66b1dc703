"""The C bf16 GEMV (cpu_gemv.c) against a plain streaming read of the same bytes.

A decode step of a few sequences reads every weight of the model's linear layers once; the
GEMV is as fast as it can be when it streams them at the rate a plain read of the same bytes
(gemv_bandwidth.c) reaches on as many threads. Both walk the decoder layers' matrices of a
Llama-shaped model in order (by default SmolLM2-135M's: hidden 576, intermediate 1536, 9 heads
and 3 KV heads of 64, 30 layers, ~212 MB of bf16, far more than the caches hold), then the
lm_head alone; the table gives the best of --repeats passes of each as GB/s, and the GEMV's as
a fraction of the faster read's (plain, or prefetching into L2 as the GEMV does), for 1 to 4
rows of x.

    python benchmarks/benchmark_gemv.py [--threads 1] [--output-json benchmarks/results/gemv.json]
"""

import argparse
import ctypes
import sys

import torch

import result_files
import roofline
from vllm.model_executor.layers import cpu_gemv

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


def _matrices(args: argparse.Namespace) -> dict[str, list[torch.Tensor]]:
    """The decoder layers' weights (N, K) in a step's order, and the lm_head's."""
    qkv = (args.heads + 2 * args.kv_heads) * args.head_dim
    shapes = [(qkv, args.hidden), (args.heads * args.head_dim, args.hidden),
              (2 * args.intermediate, args.hidden), (args.hidden, args.intermediate)]
    layers = [torch.randn(shape).div_(shape[1] ** 0.5).to(torch.bfloat16)
              for _ in range(args.layers) for shape in shapes]
    return {"layers": layers, "lm_head": [torch.randn(args.vocab, args.hidden).to(torch.bfloat16)]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=20, help="passes of each; the best counts")
    for name, default in (("hidden", 576), ("intermediate", 1536), ("heads", 9), ("kv-heads", 3),
                          ("head-dim", 64), ("layers", 30), ("vocab", 49152)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--output-json", default=None, help="write the results here (without it, only print them)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gemv = cpu_gemv.kernel_address()
    if gemv is None:
        print("no C GEMV here (it needs AVX512-BF16 and a C compiler)", file=sys.stderr)
        return 1
    lib = roofline.gemv_bandwidth_library()
    if lib is None:
        print("the benchmark's C could not be built", file=sys.stderr)
        return 1
    rows_max = cpu_gemv.max_rows()
    results = {"threads": torch.get_num_threads(), "GB_per_s": {}, "gemv_over_read": {}}
    print(f"{torch.get_num_threads()} thread(s); GB/s, best of {args.repeats}; the GEMV's as a fraction of "
          "the faster read")
    print(f"{'matrices':10s}{'MB':>8s}{'read':>8s}{'read+pf':>9s}" +
          "".join(f"{f'gemv x{m}':>16s}" for m in range(1, rows_max + 1)))
    for name, weights in _matrices(args).items():
        count = len(weights)
        pointers = (_ptr * count)(*[w.data_ptr() for w in weights])
        rows = (_i64 * count)(*[w.shape[0] for w in weights])
        cols = (_i64 * count)(*[w.shape[1] for w in weights])
        nbytes = sum(w.numel() * 2 for w in weights)
        x = torch.randn(rows_max, max(cols)).to(torch.bfloat16)                  # (M, K)
        y = torch.empty(rows_max, max(rows), dtype=torch.bfloat16)                # (M, N)
        checksum = _i64()
        runs = {key: lambda prefetch=prefetch: lib.read_seconds(pointers, rows, cols, count, prefetch,
                                                                ctypes.byref(checksum))
                for key, prefetch in (("read", 0), ("read_prefetch", 1))}
        for m in range(1, rows_max + 1):
            runs[f"gemv_x{m}"] = lambda m=m: lib.gemv_seconds(gemv, x.data_ptr(), y.data_ptr(), pointers,
                                                               rows, cols, count, m)
        # In turns, so that a load that comes and goes slows each of them alike.
        best = {key: float("inf") for key in runs}
        for _ in range(args.repeats):
            for key, run in runs.items():
                best[key] = min(best[key], run())
        speeds = {key: nbytes / seconds / 1e9 for key, seconds in best.items()}
        read = max(speeds["read"], speeds["read_prefetch"])
        results["GB_per_s"][name] = speeds
        results["gemv_over_read"][name] = {key: v / read for key, v in speeds.items() if key.startswith("gemv")}
        print(f"{name:10s}{nbytes / 1e6:8.1f}{speeds['read']:8.1f}{speeds['read_prefetch']:9.1f}" +
              "".join(f"{speeds[f'gemv_x{m}']:8.1f} ({speeds[f'gemv_x{m}'] / read:.2f})"
                      for m in range(1, rows_max + 1)))
    results.update(args=result_files.args_dict(args), machine=result_files.machine_info())
    result_files.save_results(results, args.output_json, False, "gemv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
