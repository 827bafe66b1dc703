"""What a benchmark writes: JSON results (to `benchmarks/results/<name>.json` unless a path is
given; non-finite floats as strings), the machine they were measured on (CPU model and
features, cores, load, torch version, git commit), and progress lines on stderr."""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

# Load average when the script started (scripts import this module first): the machine is shared.
_LOAD_AT_START = os.getloadavg() if hasattr(os, "getloadavg") else None


@functools.cache
def _first_cpu_fields() -> dict[str, str]:
    """The fields of the first processor listed in /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    return _first_cpu_fields().get("model name") or platform.processor() or platform.machine()


def cpu_generation() -> dict[str, int]:
    """The CPU's family and model numbers, where /proc/cpuinfo lists them: a guest's model name may
    hide the generation ("AMD EPYC" is family 25 for Zen 3 and 4, 26 for Zen 5)."""
    fields = _first_cpu_fields()
    family, model = fields.get("cpu family", ""), fields.get("model", "")
    if not (family.isdigit() and model.isdigit()):
        return {}
    return {"cpu_family": int(family), "cpu_model_number": int(model)}


def _git(*cmd: str) -> str | None:
    try:
        out = subprocess.run(["git", *cmd], cwd=REPO_DIR, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def machine_info() -> dict:
    import torch

    from vllm.platforms.cpu import cpu_flags
    info = {
        "cpu_model": cpu_model(),
        **cpu_generation(),
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


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
