"""Workloads A and C on cores that another process also wants: the slowdown per thread policy.

A server never has its cores to itself: its HTTP layer, the tokenizer and other tenants run beside
the engine. OpenMP's threads split each product evenly and meet at a barrier, so one thread that
loses its core holds the others up, and threads spinning at the barrier take cycles from the
one still working; a thread that sleeps at once instead must be woken for the next product, which
batch-1 decodes (many small products) feel most. This benchmark runs workloads A (16 prompts x
256 tokens, 64 outputs each: total tokens/s) and C (batch-1 decode tokens/s) of
benchmark_workloads.py in a fresh process per run, once alone and once beside one busy process
(a Python loop: one core's worth of demand), for each policy:

    default   whatever the engine does with no environment set: between steps the worker
              drops to the cores other processes leave it (vllm/platforms/cpu_threads.py)
    fixed     VLLM_CPU_ADAPTIVE_THREADS=0: every core's thread, whatever else runs
    passive   OMP_WAIT_POLICY=PASSIVE: threads sleep at once at a barrier instead of spinning
    spin-1k   GOMP_SPINCOUNT=1000: GNU OpenMP's threads spin a thousand rounds before they sleep
              (its default, with no policy set, is 300,000 rounds)
    spin-10k  GOMP_SPINCOUNT=10000
    1-thread  OMP_NUM_THREADS=1

and reports each run's figures and, per policy and workload, the slowdown (alone / busy) and the
figure beside the busy process and alone as fractions of the default policy's alone. The
fair share of two cores beside one busy process is one core: a slowdown of 2x. Other flags go to
benchmark_workloads.py (the engine's, such as --model, and --roofline-seconds).

    python benchmarks/benchmark_sharing.py --output-json benchmarks/results/sharing.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import result_files

HERE = Path(__file__).resolve().parent
POLICIES = {
    "default": {},
    "fixed": {"VLLM_CPU_ADAPTIVE_THREADS": "0"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin-1k": {"GOMP_SPINCOUNT": "1000"},
    "spin-10k": {"GOMP_SPINCOUNT": "10000"},
    "1-thread": {"OMP_NUM_THREADS": "1"},
}
POLICY_VARIABLES = {name for env in POLICIES.values() for name in env}
BUSY_LOOP = "while True: pass"


METRICS = {"A": "A_total_tokens_per_s", "C": "C_decode_tokens_per_s"}


def run_workloads(policy_env: dict, busy: bool, args: argparse.Namespace) -> dict[str, float]:
    """The --workloads' figures (tokens/s) in a fresh process with `policy_env`, beside a busy
    loop if `busy`."""
    env = {k: v for k, v in os.environ.items() if k not in POLICY_VARIABLES}
    env.update(policy_env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "a.json"
        cmd = [sys.executable, str(HERE / "benchmark_workloads.py"), "--workloads", args.workloads,
               "--backends", "vllm", "--scale", str(args.scale), "--output-json", str(out), *args.workload_args]
        if args.dtype:
            cmd += ["--dtype", args.dtype]
        loop = subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) if busy else None
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        finally:
            if loop is not None:
                loop.kill()
                loop.wait()
        if done.returncode != 0:
            raise RuntimeError(f"the workloads failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
        figures = json.loads(out.read_text())["workloads"]["vllm"]
        return {w: figures[METRICS[w]] for w in args.workloads.split(",")}


def main(args: argparse.Namespace) -> dict:
    runs: dict[str, dict[str, dict[str, float]]] = {}  # policy -> alone/busy -> workload -> tokens/s
    for name in args.policies.split(","):
        runs[name] = {}
        for busy in (False, True):
            mode = "busy" if busy else "alone"
            runs[name][mode] = run_workloads(POLICIES[name], busy, args)
            print(f"{name:9s} {mode:5s}: " + ", ".join(f"{w} {v:8.1f} tokens/s"
                                                       for w, v in runs[name][mode].items()), flush=True)
    reference = runs.get("default", next(iter(runs.values())))["alone"]
    summary = {name: {w: {"slowdown_busy": r["alone"][w] / r["busy"][w],
                          "alone_over_default_alone": r["alone"][w] / reference[w],
                          "busy_over_default_alone": r["busy"][w] / reference[w]}
                      for w in r["alone"]}
               for name, r in runs.items()}
    for name, per_workload in summary.items():
        for w, s in per_workload.items():
            print(f"{name:9s} {w}: slowdown beside a busy process {s['slowdown_busy']:.2f}x; of the "
                  f"default alone: {s['alone_over_default_alone']:.2f} alone, "
                  f"{s['busy_over_default_alone']:.2f} busy")
    results = {"runs_tokens_per_s": runs, "summary": summary, "policies": POLICIES,
               "args": vars(args), "machine": result_files.machine_info()}
    result_files.save_results(results, args.output_json, False, "sharing")
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; those it does not know go to benchmark_workloads.py (`workload_args`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of "
                        + ", ".join(POLICIES))
    parser.add_argument("--workloads", default="A,C", help="comma-separated subset of A,C")
    parser.add_argument("--dtype", default=None, help="the engine's dtype (default: its auto)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every length (smoke tests)")
    parser.add_argument("--output-json", default=None, help="write the results here (without it, only print them)")
    args, workload_args = parser.parse_known_args(argv)
    args.workload_args = workload_args
    unknown = set(args.policies.split(",")) - set(POLICIES)
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    if set(args.workloads.split(",")) - set(METRICS):
        parser.error("--workloads takes a subset of A,C")
    return args


if __name__ == "__main__":
    main(parse_args())
