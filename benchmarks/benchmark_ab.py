"""Two checkouts of this engine on the same workloads, alternated round by round in one run.

A shared machine's speed can move by more than a change does from one minute to the next, so two
runs of benchmark_workloads.py minutes apart cannot tell a change of 10% from the machine. Here
each checkout keeps one engine loaded in a worker process of its own (its `vllm` first on
PYTHONPATH, its C kernels built from its sources); every round runs each workload on one checkout
and then at once on the other, the order swapped every round, while the other worker waits idle
(the thread counts fixed, so that only the checkouts differ). Reported per workload:
both checkouts' figure in every round, their medians, and the speedup of this checkout over the
base (above 1: this checkout is faster).

    A  16 prompts x 256 tokens, 64 outputs each          total tokens/s
    B  one 2048-token prompt, 1 output                   time to first token (s)
    C  batch-1 decode, 16-token prompt, 128 outputs      tokens/s (the prompt's step included)

These are benchmark_workloads.py's A, B and C (`--scale` shrinks every length). Prompts are random
token ids that are not special tokens (workload_prompts.py), the same for both checkouts in a
round; every run starts from an empty prefix cache.

    git worktree add /tmp/base <commit>
    python benchmarks/benchmark_ab.py --base /tmp/base [--workloads A,B,C] [--rounds 4] \\
        [--output-json benchmarks/results/ab.json]
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from workload_prompts import random_token_ids, tokenizer_vocab

_HERE = os.path.dirname(os.path.abspath(__file__))
_THIS_CHECKOUT = os.path.dirname(_HERE)

# name -> (prompt count, prompt length, outputs, unit, whether larger is faster)
WORKLOADS = {
    "A": (16, 256, 64, "total tokens/s", True),
    "B": (1, 2048, 1, "s to the first token", False),
    "C": (1, 16, 128, "tokens/s", True),
}


def _size(n: int, scale: float) -> int:
    return max(1, round(n * scale))


# ------------------------------------------------------------------------- the worker

def _run_workload(llm, name: str, seed: int, scale: float) -> float:
    from vllm import SamplingParams

    count, length, outputs, _, _ = WORKLOADS[name]
    length, outputs = _size(length, scale), _size(outputs, scale)
    rng = random.Random(seed)
    vocab, special = tokenizer_vocab(llm.get_tokenizer())
    prompts = [{"prompt_token_ids": random_token_ids(rng, length, vocab, special)} for _ in range(count)]
    assert llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=outputs, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - start
    reasons = {o.outputs[0].finish_reason for o in outs}
    if reasons != {"length"}:  # a failed request returns early: its time would measure nothing
        raise RuntimeError(f"workload {name}: requests finished with {sorted(reasons)}, not all their tokens")
    if name == "A":
        return count * (length + outputs) / seconds
    return seconds if name == "B" else outputs / seconds


def worker(engine_kwargs: dict) -> None:
    """Loads the engine of the checkout on PYTHONPATH, then runs the workloads that stdin asks for
    (a JSON line each: workload, seed, scale), a JSON line each on stdout: {"value": ...}."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever else prints goes to the log, not into the protocol
    import vllm
    from vllm import LLM

    llm = LLM(**engine_kwargs)
    _run_workload(llm, "C", seed=-1, scale=0.05)  # warm-up
    protocol.write(json.dumps({"ready": True, "vllm": os.path.dirname(vllm.__file__)}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        value = _run_workload(llm, request["workload"], request["seed"], request["scale"])
        protocol.write(json.dumps({"value": value}) + "\n")


# ------------------------------------------------------------------------- the parent

class Worker:
    """One checkout's worker process, and its log."""

    def __init__(self, checkout: str, engine_kwargs: dict, log_dir: str, name: str) -> None:
        self.checkout = os.path.realpath(checkout)
        self.log_path = os.path.join(log_dir, f"{name}.log")
        # A fixed thread count, so that only the checkouts differ.
        env = dict(os.environ, PYTHONPATH=self.checkout, TOKENIZERS_PARALLELISM="false",
                   VLLM_CPU_ADAPTIVE_THREADS="0")
        with open(self.log_path, "w") as log:  # the worker writes to its own copy of the file
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                                          json.dumps(engine_kwargs)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True, cwd=self.checkout, env=env)

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            with open(self.log_path) as log:
                tail = log.read()[-3000:]
            raise RuntimeError(f"the worker of {self.checkout} exited with {self.proc.returncode}:\n{tail}")
        return json.loads(line)

    def wait_ready(self) -> None:
        loaded = os.path.realpath(self.receive()["vllm"])
        if not loaded.startswith(self.checkout + os.sep):
            raise RuntimeError(f"the worker of {self.checkout} imported vllm from {loaded}: is the checkout's "
                               "package shadowed by an installed one?")

    def run(self, workload: str, seed: int, scale: float) -> float:
        self.proc.stdin.write(json.dumps({"workload": workload, "seed": seed, "scale": scale}) + "\n")
        self.proc.stdin.flush()
        return self.receive()["value"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the other checkout (e.g. a git worktree of the base commit)")
    parser.add_argument("--workloads", default="A,B,C")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--model", default=None, help="default: the engine's default model")
    parser.add_argument("--dtype", default=None, help="default: the engine's auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                        help="default: the platform's choice")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose among {sorted(WORKLOADS)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not os.path.isdir(os.path.join(args.base, "vllm")):
        parser.error(f"--base {args.base} is not a checkout of this engine (no vllm/ in it)")
    return args


def _engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {"kv_cache_memory_bytes": args.kv_cache_memory_bytes, "enable_chunked_prefill": True}
    for key in ("model", "dtype", "max_model_len", "block_size", "enforce_eager"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    return kwargs


def main(argv: list[str] | None = None) -> None:
    sys.path[:0] = [_HERE]  # the helper modules beside this script
    import result_files

    args = parse_args(argv)
    names = args.workloads.split(",")
    with tempfile.TemporaryDirectory() as log_dir:
        workers = {"this": Worker(_THIS_CHECKOUT, _engine_kwargs(args), log_dir, "this"),
                   "base": Worker(args.base, _engine_kwargs(args), log_dir, "base")}
        try:
            for w in workers.values():  # both load at once; the rounds start when both are ready
                w.wait_ready()
            values = {name: {side: [] for side in workers} for name in names}
            for r in range(args.rounds):
                order = ("base", "this") if r % 2 == 0 else ("this", "base")
                for name in names:
                    for side in order:
                        values[name][side].append(workers[side].run(name, seed=r, scale=args.scale))
                    print(f"round {r} {name}: " + ", ".join(f"{side} {values[name][side][-1]:.4g}" for side in order),
                          flush=True)
        finally:
            for w in workers.values():
                w.close()
    results = {}
    for name in names:
        unit, faster_when_larger = WORKLOADS[name][3], WORKLOADS[name][4]
        this, base = (statistics.median(values[name][side]) for side in ("this", "base"))
        speedup = this / base if faster_when_larger else base / this
        results[name] = {"unit": unit, "this": values[name]["this"], "base": values[name]["base"],
                         "median_this": this, "median_base": base, "speedup_this_over_base": speedup}
        print(f"{name}: this {this:.4g}, base {base:.4g} {unit} (medians of {args.rounds}): speedup {speedup:.3f}")
    base_commit = subprocess.run(["git", "-C", args.base, "rev-parse", "HEAD"], capture_output=True, text=True)
    output = {"workloads": results, "definitions": __doc__.split("\n\n")[2],
              "base": {"path": os.path.realpath(args.base),
                       "git_commit": base_commit.stdout.strip() if base_commit.returncode == 0 else None},
              "machine": result_files.machine_info(), "args": result_files.args_dict(args)}
    if args.output_json:
        print(f"Results written to {result_files.write_json(output, args.output_json)}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
    else:
        main()
