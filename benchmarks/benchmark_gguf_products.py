"""Where the quantized products of a bf16 step cross over: the weight-stationary product
(int8 activations where the CPU has them) against the tiled one (each weight dequantized into
bf16 tiles for cpu_tile_gemm.c), per weight shape and row count, on random GGUF blocks.
cpu_gguf_gemv.c's gguf_tiled_min_rows(type) is the row count from which the tiled product wins
on these shapes (the default model's: q|k|v, o, gate|up, down; for Q4_K, whose rows are
super-blocks of 256, K rounded up to 768 and 1536) for each type.

    PYTHONPATH=$PWD python benchmarks/benchmark_gguf_products.py --output-json benchmarks/results/gguf_products.json
"""

import argparse
import time

import numpy as np
import torch

import result_files

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of SmolLM2-135M's products
ROWS = [1, 2, 3, 4, 5, 6, 8, 12, 16, 32]
TYPES = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q4_K": 12}


def _random_blocks(quant_type: int, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """(n, row bytes) uint8: the gguf package's blocks of random weights; Q4_K, which it cannot
    quantize, random bytes with d and dmin of 2^-10."""
    import gguf

    if quant_type != TYPES["Q4_K"]:
        data = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), gguf.GGMLQuantizationType(quant_type))
        return torch.from_numpy(np.ascontiguousarray(data))
    blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    blocks[..., 0:4] = np.full(2, 2.0 ** -10, dtype=np.float16).view(np.uint8)
    return torch.from_numpy(blocks.reshape(n, -1))


def _best_us(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e6


def main() -> None:
    from vllm.model_executor.layers.quantization import cpu_gguf_gemv

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default="Q4_1,Q8_0", help="comma-separated subset of Q8_0,Q4_0,Q4_1,Q4_K")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if not cpu_gguf_gemv.tiled_fits(16):
        raise SystemExit("no tile GEMM on this machine: every row count takes the weight-stationary product")
    rng = np.random.default_rng(0)
    results = []
    for name in args.types.split(","):
        quant_type = TYPES[name]
        for n, k in SHAPES:
            if name == "Q4_K":
                k = -(-k // 256) * 256
            blocks = _random_blocks(quant_type, n, k, rng)
            crossover = None
            for m in ROWS:
                x = torch.randn(m, k).bfloat16()
                times = {path: _best_us(lambda: cpu_gguf_gemv.product(x, blocks, quant_type, None, tiled=path),
                                        args.repeats) for path in (False, True)}
                if crossover is None and times[True] < times[False]:
                    crossover = m
                results.append({"type": name, "n": n, "k": k, "rows": m, "weight_stationary_us": times[False],
                                "tiled_us": times[True]})
                print(f"{name} n={n:5d} k={k:5d} rows={m:3d}  weight-stationary {times[False]:8.1f} us"
                      f"  tiled {times[True]:8.1f} us", flush=True)
            print(f"{name} n={n} k={k}: tiled from {crossover} rows", flush=True)
    if args.output_json:
        result = {"threads": torch.get_num_threads(),
                  "tiled_min_rows": {name: cpu_gguf_gemv.tiled_min_rows(TYPES[name]) for name in TYPES},
                  "results": results, "machine": result_files.machine_info(), "args": result_files.args_dict(args)}
        print(f"Results written to {result_files.write_json(result, args.output_json)}")


if __name__ == "__main__":
    main()
