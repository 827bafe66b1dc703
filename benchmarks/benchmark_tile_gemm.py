"""The packed-weight GEMM (cpu_tile_gemm.c) against oneDNN on SmolLM2-135M's linear shapes.

For each weight shape (in x out: q|k|v, o_proj, gate|up, down_proj, lm_head) and row count, bf16
products on three paths, alternated in one process: the tile GEMM on its packed copy (AMX
tiles where the CPU has them, else AVX512-BF16; `--copy` picks one), oneDNN on its own blocked
copy of the weight (torch.ops.mkldnn._linear_pointwise, what packed layers use without the tile
GEMM) and torch.nn.functional.linear on the plain weight. Each is reported as microseconds
(median of the rounds), TFLOP/s, the fraction of this machine's bf16 matmul peak (torch.matmul
2048^3, measured in the same run) and the tile GEMM's speed-up over each oneDNN path.

    PYTHONPATH=$PWD python benchmarks/benchmark_tile_gemm.py [--output-json benchmarks/results/tile_gemm.json]
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # the helper modules beside it, vllm of this checkout

from result_files import machine_info, write_json  # noqa: E402
from roofline import measure_matmul_flops  # noqa: E402
from vllm.model_executor.layers import cpu_tile_gemm  # noqa: E402

# (in, out) of SmolLM2-135M's products
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]


def _seconds(fn, min_seconds: float) -> float:
    """Mean seconds of one call, over enough calls to last `min_seconds`, after a warm-up call."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < min_seconds or calls < 3:
        fn()
        calls += 1
    return elapsed / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 256])
    parser.add_argument("--shapes", type=str, nargs="+", default=[f"{k}x{n}" for k, n in SHAPES],
                        help="in x out of each weight, e.g. 576x3072")
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the paths")
    parser.add_argument("--min-seconds", type=float, default=0.02, help="per path, round and shape")
    parser.add_argument("--copy", choices=["auto", "amx", "avx512"], default="auto",
                        help="the tile GEMM's copy: auto = AMX where the CPU has it")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--output-json", type=str, default=None)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if cpu_tile_gemm.max_rows() == 0:
        print("the tile GEMM is not available here (no C compiler, or neither AMX nor AVX512-BF16)", file=sys.stderr)
        return 1
    if args.copy != "auto" and cpu_tile_gemm.use_amx(args.copy == "amx") != (args.copy == "amx"):
        print("no AMX here", file=sys.stderr)
        return 1
    copy = "amx" if cpu_tile_gemm.use_amx(args.copy != "avx512") else "avx512"

    peak = measure_matmul_flops("bfloat16")["flops_per_s"]
    torch.manual_seed(0)
    rows_results = []
    for shape in args.shapes:
        k, n = (int(v) for v in shape.split("x"))
        weight = (torch.randn(n, k) / k ** 0.5).bfloat16()                # (out, in)
        tiled = cpu_tile_gemm.pack(weight)
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        for m in args.rows:
            x = torch.randn(m, k).bfloat16()                                # (M, in)
            paths = {"tile": lambda: cpu_tile_gemm.gemm(x, tiled, None),
                     "onednn_blocked": lambda: torch.ops.mkldnn._linear_pointwise(x, blocked, None, "none", [], ""),
                     "F.linear": lambda: F.linear(x, weight)}
            difference = (paths["tile"]().float() - F.linear(x.float(), weight.float())).abs().max().item()
            seconds = {name: [] for name in paths}
            for _ in range(args.rounds):
                for name, fn in paths.items():
                    seconds[name].append(_seconds(fn, args.min_seconds))
            row = {"in": k, "out": n, "rows": m, "max_abs_difference_from_float32": difference}
            row.update({name: {"us_median": 1e6 * statistics.median(times)} for name, times in seconds.items()})
            rows_results.append(row)
            print(f"{k:5d}x{n:<6d} M={m:<4d} " + "  ".join(f"{name} {row[name]['us_median']:8.1f} us" for name in paths)
                  + f"  tile/blocked x{row['onednn_blocked']['us_median'] / row['tile']['us_median']:.2f}")
    peak = max(peak, measure_matmul_flops("bfloat16")["flops_per_s"])  # before and after: the better
    for row in rows_results:
        flops = 2 * row["rows"] * row["in"] * row["out"]
        for name in ("tile", "onednn_blocked", "F.linear"):
            row[name]["tflops"] = flops / row[name]["us_median"] / 1e6
            row[name]["fraction_of_matmul_peak"] = row[name]["tflops"] * 1e12 / peak
            if name != "tile":
                row[f"tile_speedup_over_{name}"] = row[name]["us_median"] / row["tile"]["us_median"]
    print(f"tile GEMM copy {copy}; bf16 matmul peak {peak / 1e12:.3f} TFLOP/s; "
          f"load average {os.getloadavg()[0]:.2f}; tile fraction of the peak: "
          + ", ".join(f"{r['in']}x{r['out']} M={r['rows']} {r['tile']['fraction_of_matmul_peak']:.2f}"
                      for r in rows_results))
    if args.output_json:
        write_json({"args": vars(args), "tile_copy": copy, "matmul_peak_flops_per_s": peak,
                    "load_average_1min": os.getloadavg()[0], "products": rows_results, "machine": machine_info()},
                   args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
