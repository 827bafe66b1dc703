"""Where the quantized products of a bf16 step cross over, per weight shape and row count, on
random GGUF blocks: the weight-stationary int8 product ("int8", up to 16 rows), the int8 GEMM
on the weight's rows ("gemm") and on its 16-row panels as a loaded bf16 model holds it
("panels"), the tiled product (each weight dequantized into bf16 tiles for cpu_tile_gemm.c,
"tiled"), and the bf16 tile GEMM on the dequantized weights as the unquantized model runs it
("bf16"). The paths of a shape are timed in turns, best of several rounds, so that a busy
machine slows them alike; with --copies 30 each call reads its weight from memory, as a step
through the model's 30 layers does. The shapes are the default model's (q|k|v, o, gate|up,
down, and with --lm-head its Q8_0 lm_head; for Q4_K and Q6_K, whose rows are super-blocks of 256,
K rounded up to 768 and 1536); cpu_gguf_gemv.c's gguf_product_path encodes which product each
row count of a type takes from what this measures. Each time is also a fraction of the peak of
its instruction, measured in the same run (roofline.measure_dot_product_peaks, before and after:
the higher): the int8 products' of vpdpbusd, the bf16 products' of vdpbf16ps.

    PYTHONPATH=$PWD python benchmarks/benchmark_gguf_products.py --copies 30 --lm-head \
        --output-json benchmarks/results/gguf_products_epyc.json
"""

import argparse
import time

import numpy as np
import torch

import result_files
import roofline

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of SmolLM2-135M's products
LM_HEAD = (49152, 576)  # its tied Q8_0 embedding
ROWS = [1, 2, 3, 4, 6, 8, 16, 32, 64, 128, 256, 512]
PEAK_OF_PATH = {"int8": "int8", "gemm": "int8", "panels": "int8", "tiled": "bfloat16", "bf16": "bfloat16"}
INT8_MAX_ROWS = 16  # the weight-stationary product unpacks each block once per row: far behind past this
TYPES = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q4_K": 12, "Q6_K": 14}
SUPER_BLOCKS = {"Q4_K": 144, "Q6_K": 210}  # bytes per 256 weights of the types the gguf package cannot quantize


def _random_blocks(quant_type: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, row bytes) uint8: the gguf package's blocks of random weights; Q4_K and Q6_K, which it
    cannot quantize, random bytes with scales (d and dmin; d) of 2^-10."""
    import gguf

    kind = gguf.GGMLQuantizationType(quant_type)
    name = kind.name
    if name not in SUPER_BLOCKS:
        return np.ascontiguousarray(gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), kind))
    blocks = rng.integers(0, 256, (n, k // 256, SUPER_BLOCKS[name]), dtype=np.uint8)
    scales, count = (slice(0, 4), 2) if name == "Q4_K" else (slice(208, 210), 1)  # fp16 d, dmin; d
    blocks[..., scales] = np.full(count, 2.0 ** -10, dtype=np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def _best_us(fns: dict, copies: int, rounds: int) -> dict:
    """Each of `fns` (name -> callable of a copy's index) called once on each of `copies` copies
    of the weight, the names in turns, for `rounds` rounds: name -> the best round's
    microseconds per call."""
    for fn in fns.values():
        fn(0)  # warm-up
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for i in range(copies):
                fn(i)
            best[name] = min(best[name], (time.perf_counter() - start) / copies)
    return {name: t * 1e6 for name, t in best.items()}


def _fraction_of_peak(row: dict, path: str, peaks: dict[str, float]) -> float | None:
    """The multiply-adds per second of `path` in a result row over its instruction's rate."""
    peak = peaks.get(PEAK_OF_PATH[path])
    return row["rows"] * row["n"] * row["k"] / (row[f"{path}_us"] * 1e-6) / peak if peak else None


def main() -> None:
    from vllm.model_executor.layers import cpu_tile_gemm
    from vllm.model_executor.layers.quantization import cpu_gguf_gemv
    from vllm.model_executor.layers.quantization.gguf_blocks import PANELS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default="Q4_1,Q8_0,Q4_0", help="comma-separated subset of Q8_0,Q4_0,Q4_1,Q4_K,Q6_K")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts of x")
    parser.add_argument("--lm-head", action="store_true", help=f"also the lm_head shape {LM_HEAD} (Q8_0 only)")
    parser.add_argument("--copies", type=int, default=1,
                        help="copies of each weight, called in turn: the model's layer count (30) makes every "
                             "product read its weight from memory, as a step does, instead of from the cache")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if not cpu_gguf_gemv.int8_available():
        raise SystemExit("no int8 dot products on this machine: the float32 product serves the few rows")
    peaks = roofline.measure_dot_product_peaks()
    rng = np.random.default_rng(0)
    results = []
    for name in args.types.split(","):
        quant_type = TYPES[name]
        shapes = SHAPES + ([LM_HEAD] if args.lm_head and name == "Q8_0" else [])
        for n, k in shapes:
            if name in SUPER_BLOCKS:
                k = -(-k // 256) * 256
            data = _random_blocks(quant_type, n, k, rng)
            copies = 1 if (n, k) == LM_HEAD else args.copies  # 56 MB in bf16: read from memory anyway
            blocks = [torch.from_numpy(data.copy()) for _ in range(copies)]
            packed = [cpu_tile_gemm.pack(cpu_gguf_gemv.dequantize(b, quant_type, k, torch.bfloat16)) for b in blocks]
            panels = [cpu_gguf_gemv.to_panels(b, quant_type, k) for b in blocks]
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k).bfloat16()
                paths = {}
                if m <= INT8_MAX_ROWS:
                    paths["int8"] = lambda i: cpu_gguf_gemv.product(x, blocks[i], quant_type, None, path="int8")
                if cpu_gguf_gemv.gemm_takes(quant_type):
                    paths["gemm"] = lambda i: cpu_gguf_gemv.product(x, blocks[i], quant_type, None, path="gemm")
                if panels[0] is not None:
                    paths["panels"] = lambda i: cpu_gguf_gemv.product(x, panels[i], quant_type | PANELS, None)
                if cpu_gguf_gemv.tiled_fits(n):
                    paths["tiled"] = lambda i: cpu_gguf_gemv.product(x, blocks[i], quant_type, None, path="tiled")
                if packed[0] is not None:
                    paths["bf16"] = lambda i: cpu_tile_gemm.gemm(x, packed[i], None)
                times = _best_us(paths, copies, args.rounds)
                chosen = cpu_gguf_gemv.product_path(quant_type, m, n, k)
                if chosen == "gemm" and panels[0] is not None:
                    chosen = "panels"  # the model's weights are regrouped (gguf_linear.to_panels)
                results.append({"type": name, "n": n, "k": k, "rows": m, "chosen": chosen,
                                **{f"{path}_us": t for path, t in times.items()}})
                fastest = min((p for p in times if p != "bf16"), key=times.get)
                line = "  ".join(f"{path} {t:9.1f}" for path, t in times.items())
                ratio = f"  chosen/bf16 {times[chosen] / times['bf16']:5.2f}" if "bf16" in times else ""
                fraction = _fraction_of_peak(results[-1], chosen, peaks)
                of_peak = f"  chosen at {fraction:4.2f} of its peak" if fraction is not None else ""
                print(f"{name} n={n:5d} k={k:5d} rows={m:3d}  {line} us  fastest {fastest:5s} chosen {chosen:5s}"
                      f"{ratio}{of_peak}", flush=True)
    after = roofline.measure_dot_product_peaks()
    peaks = {kind: max(rate, after.get(kind, 0.0)) for kind, rate in peaks.items()}
    for row in results:
        row["fraction_of_peak"] = {path: _fraction_of_peak(row, path, peaks) for path in PEAK_OF_PATH
                                   if f"{path}_us" in row and PEAK_OF_PATH[path] in peaks}
    if args.output_json:
        result = {"threads": torch.get_num_threads(), "results": results, "dot_product_peaks_macs_per_s": peaks,
                  "machine": result_files.machine_info(), "args": result_files.args_dict(args)}
        print(f"Results written to {result_files.write_json(result, args.output_json)}")


if __name__ == "__main__":
    main()
