"""How close a run came to this machine's limits: a short `torch.matmul` microbenchmark and a
large-tensor copy measure the matmul peak and the memory bandwidth; prefill speed is reported as
a fraction of the matmul peak (2 x params FLOPs per token) and decode speed as a fraction of the
bandwidth (weight bytes x decode steps per second). The rates of the kernels' dot-product
instructions (dot_product_peaks.c) bound their inner loops."""

from __future__ import annotations

import argparse
import math
import time

from engine_setup import resolve_model_path
from step_stats import StepRecord


MATMUL_SECONDS = 0.3  # how long each measurement runs at least, where the caller does not say
BANDWIDTH_SECONDS = 0.5  # per bandwidth method


def measure_matmul_flops(dtype_name: str = "bfloat16", n: int = 2048, min_seconds: float | None = None,
                         max_reps: int = 200) -> dict:
    """Best-of FLOP/s of an n x n x n `torch.matmul` in `dtype` (2 n^3 FLOPs each), timed for at
    least `min_seconds` (None: MATMUL_SECONDS)."""
    import torch
    min_seconds = MATMUL_SECONDS if min_seconds is None else min_seconds
    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    c = torch.empty(n, n, dtype=dtype)
    torch.matmul(a, b, out=c)  # warm-up (kernel selection, page faults)
    best = math.inf
    total = 0.0
    reps = 0
    while (total < min_seconds or reps < 3) and reps < max_reps:
        t0 = time.perf_counter()
        torch.matmul(a, b, out=c)
        dt = time.perf_counter() - t0
        best = min(best, dt)
        total += dt
        reps += 1
    return {"flops_per_s": 2.0 * n**3 / best, "dtype": dtype_name, "n": n, "reps": reps,
            "threads": torch.get_num_threads()}


def _best_seconds(fn, min_seconds: float, max_reps: int) -> tuple[float, int]:
    """Best of repeated runs of `fn` (after an untimed one) over at least `min_seconds`."""
    fn()
    best, total, reps = math.inf, 0.0, 0
    while (total < min_seconds or reps < 3) and reps < max_reps:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best = min(best, dt)
        total += dt
        reps += 1
    return best, reps


def gemv_bandwidth_library():
    """gemv_bandwidth.c built (its plain streaming read and the GEMV walk), or None where it
    cannot be (no C compiler, no AVX2)."""
    import ctypes
    from pathlib import Path

    from vllm.platforms.c_library import CFunction, CLibrary

    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    return CLibrary(Path(__file__).with_name("gemv_bandwidth.c"), "no C streaming read", {
        "read_seconds": CFunction([ptr, ptr, ptr, i64, ctypes.c_int, ptr], ctypes.c_double),
        "gemv_seconds": CFunction([ptr, ptr, ptr, ptr, ptr, ptr, i64, i64], ctypes.c_double),
    }).get()


# dot_product_peaks.c's kinds: the instruction each inner loop of the kernels is built on.
DOT_PRODUCTS = {"float32": 0, "bfloat16": 1, "int8": 2}


def measure_dot_product_peaks(iterations: int = 2_000_000, reps: int = 5) -> dict[str, float]:
    """Best-of multiply-adds per second of the dot-product instructions (dot_product_peaks.c:
    float32 FMAs, bf16 pairs, int8 quads, or AVX2's int8 pairs) on every thread, by number type.
    Kinds this CPU lacks, or all of them where the C file cannot be built, are left out."""
    import ctypes
    from pathlib import Path

    from vllm.platforms.c_library import CFunction, CLibrary

    lib = CLibrary(Path(__file__).with_name("dot_product_peaks.c"), "no instruction peaks", {
        "peak_macs_per_s": CFunction([ctypes.c_int, ctypes.c_int64], ctypes.c_double),
    }).get()
    if lib is None:
        return {}
    peaks = {name: max(lib.peak_macs_per_s(kind, iterations) for _ in range(reps))
             for name, kind in DOT_PRODUCTS.items()}
    return {name: rate for name, rate in peaks.items() if rate > 0}


def _c_read_seconds(lib, tensor, prefetch: bool) -> float:
    """Seconds for gemv_bandwidth.c's read of `tensor` (contiguous, a multiple of 512 bytes), as
    one matrix of 256-byte rows."""
    import ctypes
    rows, cols = tensor.numel() * tensor.element_size() // 256, 128  # bf16 columns of 256 bytes
    checksum = ctypes.c_int64()
    return lib.read_seconds((ctypes.c_void_p * 1)(tensor.data_ptr()), (ctypes.c_int64 * 1)(rows),
                            (ctypes.c_int64 * 1)(cols), 1, int(prefetch), ctypes.byref(checksum))


def measure_memory_bandwidth(nbytes: int = 256 * 1024**2, min_seconds: float | None = None,
                             max_reps: int = 50) -> dict:
    """Best-of bytes/s of reading a large tensor and of copying it (the read and the write:
    2 x nbytes; the write's cache-line fills are not counted, so a copy understates the reads
    alone). A read is what a decode does with its weights: torch's sum, and where it builds, the
    plain streaming read of gemv_bandwidth.c with and without prefetching into L2 (on a shared
    machine a torch sum has come out slower than the engine's own decode reads). `bytes_per_s`,
    the bound quoted, is the largest. Each method runs for at least `min_seconds` (None:
    BANDWIDTH_SECONDS)."""
    import torch
    min_seconds = BANDWIDTH_SECONDS if min_seconds is None else min_seconds
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    read, read_reps = _best_seconds(src.sum, min_seconds, max_reps)
    copy, copy_reps = _best_seconds(lambda: dst.copy_(src), min_seconds, max_reps)
    result = {"read_bytes_per_s": n * 4 / read, "copy_bytes_per_s": 2.0 * n * 4 / copy, "tensor_bytes": n * 4,
              "reps": read_reps + copy_reps, "threads": torch.get_num_threads()}
    lib = gemv_bandwidth_library()
    if lib is not None:
        for key, prefetch in (("c_read_bytes_per_s", False), ("c_read_prefetch_bytes_per_s", True)):
            seconds, reps = _best_seconds(lambda: _c_read_seconds(lib, src, prefetch), min_seconds, max_reps)
            result[key], result["reps"] = n * 4 / seconds, result["reps"] + reps
    result["bytes_per_s"] = max(v for k, v in result.items() if k.endswith("bytes_per_s"))
    return result


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def model_param_counts(model_path: str) -> dict:
    """Parameter counts of a checkpoint from its config, by building the model on the meta device.

    `matmul_body` = every parameter except the embedding table and the LM head (the decoder's
    weights, which every token multiplies); `lm_head` = the output projection (only sampled rows
    use it; tied or not, it is read once per step that samples).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from vllm.model_executor.model_loader import load_hf_config, resolve_model_source
    config = load_hf_config(resolve_model_source(model_path))  # as the engine reads it
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    head_w = head.weight if head is not None else embed
    total = sum(p.numel() for p in model.parameters())  # tied weights appear once
    tied = head_w is embed
    body = total - embed.numel() - (0 if tied else head_w.numel())
    return {"total": total, "embedding": embed.numel(), "lm_head": head_w.numel(),
            "matmul_body": body, "tied_embeddings": tied,
            "hidden_size": getattr(config, "hidden_size", None),
            "vocab_size": getattr(config, "vocab_size", None),
            "num_hidden_layers": getattr(config, "num_hidden_layers", None)}


def add_roofline_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--roofline-seconds", type=_positive_seconds, default=None,
                        help="time each machine-limit measurement (the matmul, each bandwidth method) "
                             f"for at least this long (default: {MATMUL_SECONDS} s for the matmul, "
                             f"{BANDWIDTH_SECONDS} s per bandwidth method); shorter is quicker and noisier")


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def matmul_peak_dtype(dtype_name: str) -> str:
    """The dtype whose matmul peak bounds a run in `dtype_name`. bf16 on a CPU without bf16 dot
    products has no peak of its own: torch converts its operands to float32 as it goes, far
    below the float32 rate, and the engine's bf16 work takes float32 GEMMs or int8 products
    there (gguf_linear.py, cpu_attn.py); the float32 FMAs bound it."""
    from vllm.platforms.cpu import cpu_has_native_bf16_dot

    if dtype_name not in ("bfloat16", "float16", "float32"):
        dtype_name = "bfloat16"
    return "float32" if dtype_name == "bfloat16" and not cpu_has_native_bf16_dot() else dtype_name


def measure_machine_roofline(dtype_name: str, min_seconds: float | None = None) -> dict:
    """The two machine ceilings, measured now with the current torch thread count (each for at
    least `min_seconds`; None: its own default), and the dot-product instructions' rates beside
    them (multiply-adds per second). The matmul's dtype: `matmul_peak_dtype`."""
    matmul = measure_matmul_flops(matmul_peak_dtype(dtype_name), min_seconds=min_seconds)
    bandwidth = measure_memory_bandwidth(min_seconds=min_seconds)
    return {"matmul": matmul, "memory": bandwidth, "dot_products_macs_per_s": measure_dot_product_peaks()}


def roofline_report(params: dict, dtype_name: str, machine: dict, records: list[StepRecord] | None,
                    fallback: dict | None = None, weight_bytes: int | None = None) -> dict:
    """Prefill as a fraction of the matmul peak, decode as a fraction of memory bandwidth.

    Prefill: the steps that computed any prefill tokens (prefill-only and mixed steps);
      achieved FLOP/s = 2 x (matmul_body x tokens computed + lm_head x rows sampled) / their time.
      Attention FLOPs are left out, so this slightly understates the work at long contexts.
    Decode: the steps that computed only decode tokens; each reads every weight once, so
      achieved bytes/s = weight bytes x decode steps per second, the weight bytes as the engine
      holds them (`weight_bytes`: GGUF blocks at their own size) or, without them,
      (matmul_body + lm_head) x dtype bytes.
    `fallback` ({"elapsed", "prefill_tokens", "decode_tokens", "num_steps"}) is used when no
    per-step records exist: then the whole run counts for both (a lower bound).
    """
    elem = _DTYPE_BYTES.get(dtype_name, 2)
    peak = machine["matmul"]["flops_per_s"]
    bandwidth = machine["memory"]["bytes_per_s"]
    as_loaded = weight_bytes is not None
    if not as_loaded:
        weight_bytes = (params["matmul_body"] + params["lm_head"]) * elem
    report = {
        "dtype": dtype_name,
        "params": params,
        "weight_bytes_per_step": weight_bytes,
        "weight_bytes_source": "as loaded" if as_loaded else "parameters x dtype",
        "flops_per_token": 2 * params["matmul_body"],
        "peak_matmul_flops_per_s": peak,
        "matmul_benchmark": machine["matmul"],
        "memory_bandwidth_bytes_per_s": bandwidth,
        "memory_benchmark": machine["memory"],
        "prefill": None,
        "decode": None,
    }
    if records:
        pre = [r for r in records if r.prefill_tokens > 0]
        dec = [r for r in records if r.prefill_tokens == 0 and r.decode_tokens > 0]
        source = "per-step timings"
    elif fallback and fallback.get("elapsed"):
        pre = dec = None
        source = "whole run (no per-step timings)"
    else:
        return report
    report["source"] = source
    if pre is not None:
        if pre:
            secs = sum(r.seconds for r in pre)
            tokens = sum(r.tokens for r in pre)
            prefill_tokens = sum(r.prefill_tokens for r in pre)
            sampled = sum(r.num_outputs for r in pre)
            flops = 2.0 * (params["matmul_body"] * tokens + params["lm_head"] * sampled)
            report["prefill"] = {
                "steps": len(pre), "mixed_steps": sum(1 for r in pre if r.decode_tokens),
                "seconds": secs, "prefill_tokens": prefill_tokens, "tokens_computed": tokens,
                "prefill_tokens_per_s": prefill_tokens / secs if secs else None,
                "achieved_flops_per_s": flops / secs if secs else None,
                "fraction_of_matmul_peak": flops / secs / peak if secs and peak else None}
        if dec:
            secs = sum(r.seconds for r in dec)
            steps_per_s = len(dec) / secs if secs else None
            report["decode"] = {
                "steps": len(dec), "seconds": secs,
                "decode_tokens": sum(r.decode_tokens for r in dec),
                "decode_steps_per_s": steps_per_s,
                "decode_tokens_per_s": sum(r.decode_tokens for r in dec) / secs if secs else None,
                "mean_batch": sum(r.decode_tokens for r in dec) / len(dec),
                "achieved_weight_bytes_per_s": weight_bytes * steps_per_s if steps_per_s else None,
                "fraction_of_bandwidth": (weight_bytes * steps_per_s / bandwidth
                                          if steps_per_s and bandwidth else None)}
    else:
        secs = fallback["elapsed"]
        tokens = fallback.get("prefill_tokens", 0) + fallback.get("decode_tokens", 0)
        flops = 2.0 * params["matmul_body"] * tokens
        report["prefill"] = {"seconds": secs, "prefill_tokens": fallback.get("prefill_tokens", 0),
                             "tokens_computed": tokens,
                             "prefill_tokens_per_s": fallback.get("prefill_tokens", 0) / secs,
                             "achieved_flops_per_s": flops / secs,
                             "fraction_of_matmul_peak": flops / secs / peak if peak else None}
        steps = fallback.get("num_steps", 0)
        report["decode"] = {"steps": steps, "seconds": secs, "decode_steps_per_s": steps / secs,
                            "achieved_weight_bytes_per_s": weight_bytes * steps / secs,
                            "fraction_of_bandwidth": weight_bytes * steps / secs / bandwidth
                            if bandwidth else None}
    return report


def compute_roofline(model: str | None, dtype_name: str, records: list[StepRecord] | None,
                     fallback: dict | None = None, weight_bytes: int | None = None,
                     min_seconds: float | None = None) -> dict:
    """Parameter counts + machine measurements (see measure_machine_roofline) + the report;
    errors become {"error": ...}. `weight_bytes`: the weights' bytes as the engine holds them,
    where known."""
    try:
        params = model_param_counts(resolve_model_path(model))
        machine = measure_machine_roofline(dtype_name, min_seconds)
        return roofline_report(params, dtype_name, machine, records, fallback, weight_bytes)
    except Exception as e:  # a roofline problem must not lose the benchmark's result
        return {"error": f"{type(e).__name__}: {e}"}


def print_roofline(report: dict | None) -> None:
    if not report:
        return
    if "error" in report:
        print(f"Roofline: not computed ({report['error']})")
        return
    print(f"Roofline: matmul peak {report['peak_matmul_flops_per_s'] / 1e9:.1f} GFLOP/s "
          f"({report['dtype']}), memory bandwidth {report['memory_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")
    pre, dec = report.get("prefill"), report.get("decode")
    if pre and pre.get("fraction_of_matmul_peak") is not None:
        print(f"  prefill: {pre['prefill_tokens_per_s']:.1f} prompt tokens/s, "
              f"{pre['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s = "
              f"{100 * pre['fraction_of_matmul_peak']:.1f}% of the matmul peak")
    if dec and dec.get("fraction_of_bandwidth") is not None:
        print(f"  decode: {dec['decode_steps_per_s']:.2f} steps/s x "
              f"{report['weight_bytes_per_step'] / 1e6:.1f} MB of weights ({report['weight_bytes_source']}) = "
              f"{100 * dec['fraction_of_bandwidth']:.1f}% of the memory bandwidth")
