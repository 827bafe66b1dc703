"""Workload A on cores that another process also wants: the slowdown under each thread policy.

A server never has its cores to itself: its HTTP layer, the tokenizer and other tenants run beside
the engine. OpenMP's threads split each product evenly and meet at a barrier, so one thread that
loses its core holds the others up, and threads spinning at the barrier take cycles from the
one still working. This benchmark runs workload A (16 prompts x 256 tokens, 64 outputs each, of
benchmark_workloads.py) in a fresh process per run, once alone and once beside one busy process
(a Python loop: one core's worth of demand), for each policy:

    default   whatever the engine does with no environment set
    passive   OMP_WAIT_POLICY=PASSIVE: threads sleep at once at a barrier instead of spinning
    1-thread  OMP_NUM_THREADS=1

and reports each run's total tokens/s and, per policy, the slowdown (alone / busy throughput)
and the throughput beside the busy process as a fraction of the default policy's alone. The
fair share of two cores beside one busy process is one core: a slowdown of 2x.

    python benchmarks/benchmark_sharing.py --output-json benchmarks/results/sharing.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import common

HERE = Path(__file__).resolve().parent
POLICIES = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "1-thread": {"OMP_NUM_THREADS": "1"},
}
BUSY_LOOP = "while True: pass"


def run_a(policy_env: dict, busy: bool, args: argparse.Namespace) -> float:
    """Total tokens/s of workload A in a fresh process with `policy_env`, beside a busy loop if `busy`."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env.update(policy_env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "a.json"
        cmd = [sys.executable, str(HERE / "benchmark_workloads.py"), "--workloads", "A",
               "--backends", "vllm", "--scale", str(args.scale), "--output-json", str(out)]
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
            raise RuntimeError(f"workload A failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())["workloads"]["vllm"]["A_total_tokens_per_s"]


def main(args: argparse.Namespace) -> dict:
    runs: dict[str, dict[str, float]] = {}
    for name in args.policies.split(","):
        runs[name] = {}
        for busy in (False, True):
            mode = "busy" if busy else "alone"
            runs[name][mode] = run_a(POLICIES[name], busy, args)
            print(f"{name:9s} {mode:5s}: {runs[name][mode]:8.1f} total tokens/s", flush=True)
    reference = runs.get("default", next(iter(runs.values())))["alone"]
    summary = {name: {"slowdown_busy": r["alone"] / r["busy"],
                      "busy_over_default_alone": r["busy"] / reference} for name, r in runs.items()}
    for name, s in summary.items():
        print(f"{name:9s} slowdown beside a busy process {s['slowdown_busy']:.2f}x, "
              f"throughput {s['busy_over_default_alone']:.2f} of the default alone")
    results = {"runs_total_tokens_per_s": runs, "summary": summary, "policies": POLICIES,
               "args": vars(args), "machine": common.machine_info()}
    common.save_results(results, args.output_json, False, "sharing")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of "
                        + ", ".join(POLICIES))
    parser.add_argument("--dtype", default=None, help="the engine's dtype (default: its auto)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every length (smoke tests)")
    parser.add_argument("--output-json", default=None, help="write the results here (without it, only print them)")
    main(parser.parse_args())
