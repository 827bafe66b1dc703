"""The C GEMV for decode rows (cpu_gemv.c in bf16, cpu_gemv_f32.c in float32) against a plain
streaming read of the same bytes, and against F.linear.

A decode step of a few sequences reads every weight of the model's linear layers once; the
GEMV is as fast as it can be when it streams them at the rate a plain read of the same bytes
(gemv_bandwidth.c) reaches on as many threads. Both walk the decoder layers' matrices of a
Llama-shaped model in order (by default SmolLM2-135M's: hidden 576, intermediate 1536, 9 heads
and 3 KV heads of 64, 30 layers, ~212 MB of bf16, far more than the caches hold), then the
lm_head alone; the table gives the best of --repeats passes of each as GB/s, and the GEMV's and
F.linear's as fractions of the faster read's (plain, or prefetching into L2 as the bf16 GEMV
does), for 1 to 4 rows of x (bf16), or 1 to 128 (float32: past the few rows that are bound by
the weights' bytes, where the float32 kernel hands over to F.linear).

    python benchmarks/benchmark_gemv.py [--dtype float32] [--rows 1,2,4] [--threads 1] [--output-json F]
"""

import argparse
import ctypes
import sys
import time

import torch
import torch.nn.functional as F

import result_files
import roofline
from vllm.model_executor.layers import cpu_gemv

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


def _matrices(args: argparse.Namespace, dtype: torch.dtype) -> dict[str, list[torch.Tensor]]:
    """The decoder layers' weights (N, K) in a step's order, and the lm_head's."""
    qkv = (args.heads + 2 * args.kv_heads) * args.head_dim
    shapes = [(qkv, args.hidden), (args.heads * args.head_dim, args.hidden),
              (2 * args.intermediate, args.hidden), (args.hidden, args.intermediate)]
    layers = [torch.randn(shape).div_(shape[1] ** 0.5).to(dtype) for _ in range(args.layers) for shape in shapes]
    return {"layers": layers, "lm_head": [torch.randn(args.vocab, args.hidden).to(dtype)]}


def _linear_seconds(x_by_k: dict[int, torch.Tensor], weights: list[torch.Tensor]) -> float:
    """Seconds for F.linear on each weight in turn, of the rows x_by_k has for its K."""
    start = time.perf_counter()
    for w in weights:
        F.linear(x_by_k[w.shape[1]], w)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=20, help="passes of each; the best counts")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the weights' and x's dtype, and so the kernel timed")
    parser.add_argument("--rows", default=None,
                        help="comma-separated row counts of x (default: 1-4 for bf16, "
                             "1, 2, 4 ... 64 and 128 for float32)")
    for name, default in (("hidden", 576), ("intermediate", 1536), ("heads", 9), ("kv-heads", 3),
                          ("head-dim", 64), ("layers", 30), ("vocab", 49152)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--output-json", default=None, help="write the results here (without it, only print them)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gemv = cpu_gemv.kernel_address(dtype)
    if gemv is None:
        needs = "AVX512-BF16" if dtype == torch.bfloat16 else "AVX2 with FMA"
        print(f"no C {args.dtype} GEMV here (it needs {needs} and a C compiler)", file=sys.stderr)
        return 1
    lib = roofline.gemv_bandwidth_library()
    if lib is None:
        print("the benchmark's C could not be built", file=sys.stderr)
        return 1
    if args.rows is not None:
        row_counts = [int(r) for r in args.rows.split(",")]
    else:
        row_counts = [1, 2, 3, 4]
        if dtype == torch.float32:
            row_counts = [1, 2, 4, 8, 16, 32, 48, 64, 128]
    if dtype == torch.bfloat16 and not all(1 <= m <= cpu_gemv.max_rows() for m in row_counts):
        parser.error(f"--rows: the bf16 GEMV takes 1 to {cpu_gemv.max_rows()} rows")
    if not all(m >= 1 for m in row_counts):
        parser.error("--rows: row counts are at least 1")
    rows_max = max(row_counts)
    results = {"dtype": args.dtype, "rows": row_counts, "threads": torch.get_num_threads(), "GB_per_s": {},
               "gemv_over_read": {}, "linear_over_read": {}}
    print(f"{args.dtype}, {torch.get_num_threads()} thread(s); GB/s, best of {args.repeats}; the GEMV's and "
          "F.linear's as fractions of the faster read")
    print(f"{'matrices':10s}{'MB':>8s}{'read':>8s}{'read+pf':>9s}" +
          "".join(f"{f'{kind} x{m}':>16s}" for kind in ("gemv", "linear") for m in row_counts))
    for name, weights in _matrices(args, dtype).items():
        count = len(weights)
        pointers = (_ptr * count)(*[w.data_ptr() for w in weights])
        rows = (_i64 * count)(*[w.shape[0] for w in weights])
        cols = (_i64 * count)(*[w.shape[1] for w in weights])
        # the read counts its matrices in 2-byte columns
        read_cols = (_i64 * count)(*[w.shape[1] * w.element_size() // 2 for w in weights])
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        x = torch.randn(rows_max, max(cols)).to(dtype)                            # (M, K)
        y = torch.empty(rows_max, max(rows), dtype=dtype)                         # (M, N)
        checksum = _i64()
        runs = {key: lambda prefetch=prefetch: lib.read_seconds(pointers, rows, read_cols, count, prefetch,
                                                                ctypes.byref(checksum))
                for key, prefetch in (("read", 0), ("read_prefetch", 1))}
        for m in row_counts:
            runs[f"gemv_x{m}"] = lambda m=m: lib.gemv_seconds(gemv, x.data_ptr(), y.data_ptr(), pointers,
                                                               rows, cols, count, m)
        for m in row_counts:
            x_by_k = {k: x[:m, :k].contiguous() for k in set(cols)}
            runs[f"linear_x{m}"] = lambda x_by_k=x_by_k: _linear_seconds(x_by_k, weights)
        # In turns, so that a load that comes and goes slows each of them alike.
        best = {key: float("inf") for key in runs}
        for _ in range(args.repeats):
            for key, run in runs.items():
                best[key] = min(best[key], run())
        speeds = {key: nbytes / seconds / 1e9 for key, seconds in best.items()}
        read = max(speeds["read"], speeds["read_prefetch"])
        results["GB_per_s"][name] = speeds
        for kind in ("gemv", "linear"):
            results[f"{kind}_over_read"][name] = {key: v / read for key, v in speeds.items() if key.startswith(kind)}
        print(f"{name:10s}{nbytes / 1e6:8.1f}{speeds['read']:8.1f}{speeds['read_prefetch']:9.1f}" +
              "".join(f"{speeds[f'{kind}_x{m}']:8.1f} ({speeds[f'{kind}_x{m}'] / read:.2f})"
                      for kind in ("gemv", "linear") for m in row_counts))
    results.update(args=result_files.args_dict(args), machine=result_files.machine_info())
    result_files.save_results(results, args.output_json, False, "gemv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
