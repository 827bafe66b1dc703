"""Online serving benchmark over HTTP: an arrival process of streamed requests against the
OpenAI-compatible server (`vllm serve`), with vLLM's benchmark_serving flags and metrics.

Every request is a streamed, greedy completion (`--endpoint /v1/completions`, prompts sent as token
ids so they have exactly their length; `/v1/chat/completions` sends the decoded text) and every
chunk's arrival is timed on the client. Metrics as vLLM's:
  TTFT  time to first token, from the request's scheduled send time (client queueing included)
  TPOT  (E2E latency - TTFT) / (output tokens - 1), per request
  ITL   every gap between consecutive chunks of a request
  E2EL  end-to-end latency, send time to last token
each as mean / median / std / --metric-percentiles for the --percentile-metrics, plus request and
token throughput and goodput: requests per second meeting every SLO of --goodput ("KEY:VALUE",
keys ttft, tpot, e2el, milliseconds, e.g. --goodput ttft:2000 tpot:200). The server's /metrics is
read before and after each run: its steps, mixed steps, preemptions and mean prefill chunk, and its
own overhead per request (the client's mean TTFT and E2EL minus the engine's: HTTP, JSON and the
hand-off between the event loop and the engine's steps).

Arrivals (vLLM's rule): inter-arrival times are gamma distributed with shape --burstiness and mean
1 / --request-rate (burstiness 1 = Poisson); --request-rate inf sends all at once;
--max-concurrency caps the requests in flight.

Workloads (--dataset-name, seeded by --seed; prompts are random non-special token ids):
  mixed (default)  chat-like traffic with a few long documents: --long-fraction (default 0.1, at
                   least one request) of the --num-prompts requests have --long-input-len (default
                   1500:2000) prompt tokens, the rest --short-input-len (default 16:128); each
                   generates --output-len-range (default 32:128) tokens (inclusive A:B ranges)
  random           vLLM's: --random-input-len / --random-output-len, each uniform in
                   [len * (1 - --random-range-ratio), len * (1 + ratio)]
  sharegpt         --dataset-path FILE of ShareGPT records (first turn the prompt, the second's
                   length the output length), or our JSON/JSONL records {"prompt" |
                   "prompt_token_ids", "output_len"}; the first --num-prompts, in order
Outputs have exactly the requested length (ignore_eos) unless --no-ignore-eos.

Servers:
  default            a running server at --base-url, or http://--host:--port
  --compare-chunked  starts `vllm serve --model` twice on free loopback ports, chunked prefill on
                     and then off, with every flag this script does not know passed to it (engine
                     arguments: --max-num-batched-tokens 512 --block-size 16 ...; the unchunked
                     server keeps its own token budget, max(max_model_len, 2048), since a whole
                     prompt must fit one step, and drops --max-step-latency-ms), and runs the same
                     workload and arrival times on each
  --capacity-search --itl-slo-ms T [T ...]
                     per server and target T, the highest request rate whose P99 ITL <= T and whose
                     TTFT at --ttft-slo-percentile (99) <= --ttft-slo-ms (10000), Sarathi-Serve's
                     capacity, on a geometric grid of --rate-steps rates from --min-rate to
                     --max-rate (default 0.25 to 16, each sqrt(2) times the previous): from
                     --start-rate (1) the rate doubles while the probes meet the target (halves
                     while they miss) until it is bracketed, then the bracket is bisected; each
                     rate runs once per server and is judged against every target. A probe at rate
                     r sends r x --probe-seconds (24) requests of the workload, at least
                     --probe-min-prompts (16), with prompts of its own (--num-prompts does not
                     apply), and is cut short --ttft-slo-ms + 30 s after its last arrival (what is
                     left counts as failed); the mixed workload then has --long-fraction 0.25
  --compare-budgets B [B ...]
                     with --capacity-search: starts one server per target T (--max-step-latency-ms
                     T, the largest B as --max-num-batched-tokens) and one per fixed budget B, and
                     says per target whether the latency target's capacity is at least the best
                     fixed budget's (benchmarks/serving_capacity.py)

Results (--save-result or --output-json): JSON with vLLM's keys (duration, completed,
total_input_tokens, total_output_tokens, request_throughput, "request_goodput:", output_throughput,
total_token_throughput, mean/median/std/pNN _ttft/_tpot/_itl/_e2el _ms, ttfts, itls, ...), every
run under "runs"; and, with matplotlib, a PNG beside it (or --plot PATH): (a) each request's
timeline (waiting for its first token, then decoding) and (b) the inter-token latencies over time.

    python benchmarks/benchmark_serving.py --compare-chunked --model M --max-num-batched-tokens 512
    vllm serve M &  python benchmarks/benchmark_serving.py --model M --request-rate 2 --save-result
    python benchmarks/benchmark_serving.py --base-url http://127.0.0.1:8000 --capacity-search --itl-slo-ms 500
    python benchmarks/benchmark_serving.py --capacity-search --itl-slo-ms 50 100 200 \
        --compare-budgets 128 256 512 2048 --save-result
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import result_files  # noqa: E402
import engine_setup  # noqa: E402
import serving_capacity  # noqa: E402
import workload_prompts  # noqa: E402
from serving_http import (LaunchedServer, RequestRecord, request_body, run_requests,  # noqa: E402
                          scrape_metrics, server_report)

GOODPUT_KEYS = ("ttft", "tpot", "e2el")
# For the capacity search's run-time estimate: a server's start-up with warm-up, and a probe's
# tail after its last arrival.
ESTIMATED_STARTUP_S = 25.0
ESTIMATED_DRAIN_S = 8.0
# A capacity probe is cut short this long past its last arrival and --ttft-slo-ms.
PROBE_DRAIN_S = 30.0
METRICS = (("ttft", "TTFT", "Time to First Token"),
           ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
           ("itl", "ITL", "Inter-token Latency"),
           ("e2el", "E2EL", "End-to-end Latency"))


# --------------------------------------------------------------------------- workload

def parse_range(text: str) -> tuple[int, int]:
    """'A:B' (inclusive) or 'N' -> (A, B)."""
    try:
        if ":" in text:
            lo, hi = (int(x) for x in text.split(":", 1))
        else:
            lo = hi = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B or N, got {text!r}") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"need 1 <= A <= B, got {text!r}")
    return lo, hi


def make_workload(args: argparse.Namespace, tokenizer, n: int | None = None, seed: int | None = None) -> list[dict]:
    """[{"prompt_token_ids", "prompt_len", "output_len", "kind"}] in arrival order: `n` requests
    (default --num-prompts) drawn with `seed` (default --seed)."""
    n = args.num_prompts if n is None else n
    if args.dataset_path is not None:
        reqs = workload_prompts.load_dataset(args.dataset_path, tokenizer, n)
        for r in reqs:
            r["kind"] = "dataset"
        return reqs
    vocab, special = workload_prompts.tokenizer_vocab(tokenizer)
    rng = random.Random(args.seed if seed is None else seed)
    specs: list[tuple[int, int, str]] = []
    if args.dataset_name == "random":
        def length(mean: int) -> int:
            lo = max(1, int(mean * (1 - args.random_range_ratio)))
            hi = max(lo, int(mean * (1 + args.random_range_ratio)))
            return rng.randint(lo, hi)
        specs = [(length(args.random_input_len), length(args.random_output_len), "random")
                 for _ in range(n)]
    else:
        num_long = 0
        if args.long_fraction > 0:
            num_long = min(n - 1 if n > 1 else n, max(1, round(n * args.long_fraction)))
        long_positions = set(rng.sample(range(1, n) if n > 1 else range(n), num_long))
        for i in range(n):
            kind = "long" if i in long_positions else "short"
            prompt_range = args.long_input_len if kind == "long" else args.short_input_len
            specs.append((rng.randint(*prompt_range), rng.randint(*args.output_len_range), kind))
    return [{"prompt_token_ids": workload_prompts.random_token_ids(rng, p, vocab, special), "prompt_len": p,
             "output_len": o, "kind": kind} for p, o, kind in specs]


def probe_size(args: argparse.Namespace, rate: float) -> int:
    """Requests of a capacity probe at `rate`: --probe-seconds of arrivals, at least
    --probe-min-prompts (a dataset has only so many)."""
    return max(args.probe_min_prompts, math.ceil(rate * args.probe_seconds))


def probe_workload(args: argparse.Namespace, tokenizer, index: int, rate: float,
                   chat: bool) -> tuple[list[dict], list[float]]:
    """(workload, unit inter-arrival gaps) of a capacity probe at `rate`, the grid's `index`-th:
    the same on every server, and each rate with prompts of its own (seeded by its index), so
    that no probe reads the prefix cache an earlier one filled."""
    seed = args.seed + 1 + index
    workload = fresh_prompts(make_workload(args, tokenizer, probe_size(args, rate), seed), tokenizer, seed, chat)
    return workload, unit_intervals(len(workload), args.burstiness, seed)


def probe_definition(args: argparse.Namespace, probed: dict[float, list[dict]]) -> dict:
    """What the capacity probes send, for the results: the rule, and per probed rate its requests."""
    rule = {"probe_seconds": args.probe_seconds, "probe_min_prompts": args.probe_min_prompts,
            "burstiness": args.burstiness, "seed": args.seed, "dataset_path": args.dataset_path}
    if args.dataset_path is None:
        rule["dataset_name"] = args.dataset_name
        rule.update({"long_fraction": args.long_fraction, "short_input_len": args.short_input_len,
                     "long_input_len": args.long_input_len, "output_len_range": args.output_len_range}
                    if args.dataset_name == "mixed" else
                    {"random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
                     "random_range_ratio": args.random_range_ratio})
    rule["per_rate"] = {f"{rate:g}": {"num_prompts": len(w), "num_long": sum(r["kind"] == "long" for r in w),
                                      "prompt_tokens": sum(r["prompt_len"] for r in w),
                                      "output_tokens": sum(r["output_len"] for r in w)}
                        for rate, w in sorted(probed.items())}
    return rule


def fresh_prompts(workload: list[dict], tokenizer, seed: int, chat: bool) -> list[dict]:
    """The workload with new random prompt tokens of the same lengths (dataset prompts stay as
    they are): a capacity probe sends prompts of its own, so that the server's prefix cache does
    not serve them from an earlier probe."""
    vocab, special = workload_prompts.tokenizer_vocab(tokenizer)
    rng = random.Random(seed)
    out = []
    for w in workload:
        if w["kind"] != "dataset":
            w = dict(w, prompt_token_ids=workload_prompts.random_token_ids(rng, w["prompt_len"], vocab, special))
            if chat:
                w["prompt_text"] = tokenizer.decode(w["prompt_token_ids"])
        out.append(w)
    return out


def unit_intervals(n: int, burstiness: float, seed: int) -> list[float]:
    """Inter-arrival gaps for rate 1: gamma(shape=burstiness, scale=1/burstiness), mean 1."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / burstiness, size=n).tolist()


def arrival_offsets(intervals: list[float], rate: float) -> list[float]:
    """Arrival time of each request (seconds after the start); the first arrives at 0."""
    if math.isinf(rate):
        return [0.0] * len(intervals)
    offsets, t = [], 0.0
    for i, gap in enumerate(intervals):
        if i:
            t += gap / rate
        offsets.append(t)
    return offsets


# --------------------------------------------------------------------------- metrics

def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for pair in pairs or []:
        try:
            name, value = pair.split(":")
            slos[name] = float(value)
        except ValueError:
            raise ValueError(
                f"invalid --goodput item {pair!r}: service level objectives are KEY:VALUE pairs, "
                "the key a metric name and the value a number in milliseconds") from None
        if name not in GOODPUT_KEYS:
            raise ValueError(f"invalid --goodput metric {name!r}; choose from {list(GOODPUT_KEYS)}")
        if slos[name] < 0:
            raise ValueError(f"invalid --goodput value {pair!r}: must be non-negative")
    return slos


def num_output_tokens(r: RequestRecord) -> int:
    """The server's count (usage) when it sent one, else the chunks received."""
    return r.output_tokens if r.output_tokens is not None else len(r.token_times)


def compute_metrics(records: list[RequestRecord], duration: float, slos: dict[str, float],
                    metric_percentiles: list[float]) -> dict:
    """vLLM's serving metrics (keys and conventions) for one run."""
    import numpy as np

    ok = [r for r in records if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    itls = [gap for r in ok for gap in r.itl]
    tpots, all_tpots = [], []
    for r in ok:
        n = num_output_tokens(r)
        tpot = (r.latency - r.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)  # output_len 1 counts as tpot 0 for goodput, as in vLLM
    good = 0
    if slos:
        per_req = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        for i in range(len(ok)):
            if all(per_req[k][i] <= v / 1000.0 for k, v in slos.items()):
                good += 1
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(num_output_tokens(r) for r in ok)
    dur = max(duration, 1e-9)
    result = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / dur,
        "request_goodput:": good / dur if slos else None,  # vLLM's key, colon included
        "request_goodput": good / dur if slos else None,
        "output_throughput": total_output / dur,
        "total_token_throughput": (total_input + total_output) / dur,
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [num_output_tokens(r) if r.success else 0 for r in records],
        "kinds": [r.kind for r in records],
        "arrival_times": [r.arrival for r in records],
        "ttfts": [r.ttft if r.success else None for r in records],
        "itls": [r.itl if r.success else [] for r in records],
        "token_times": [r.token_times for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error or "" for r in records],
        "goodput_slos_ms": slos or None,
    }
    values = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for key, _, _ in METRICS:
        arr = np.asarray(values[key] or [0.0], dtype=float) * 1000.0
        result[f"mean_{key}_ms"] = float(arr.mean())
        result[f"median_{key}_ms"] = float(np.median(arr))
        result[f"std_{key}_ms"] = float(arr.std())
        result[f"max_{key}_ms"] = float(arr.max())
        for p in metric_percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            result[f"p{word}_{key}_ms"] = float(np.percentile(arr, p))
    # TTFT / E2EL by request kind (short chat vs long document), when the workload has both.
    kinds = sorted({r.kind for r in ok})
    if len(kinds) > 1:
        result["by_kind"] = {
            k: {"completed": sum(1 for r in ok if r.kind == k),
                "mean_ttft_ms": 1000 * float(np.mean([r.ttft for r in ok if r.kind == k])),
                "mean_e2el_ms": 1000 * float(np.mean([r.latency for r in ok if r.kind == k])),
                "p99_itl_ms": 1000 * float(np.percentile(
                    [g for r in ok if r.kind == k for g in r.itl] or [0.0], 99))}
            for k in kinds}
    return result


def print_result(result: dict, title: str, metric_percentiles: list[float],
                 percentile_metrics: list[str] = ("ttft", "tpot", "itl", "e2el")) -> None:
    print("{s:{c}^{n}}".format(s=f" {title} ", n=50, c="="))
    print("{:<40} {:<10}".format("Successful requests:", result["completed"]))
    if result["failed"]:
        print("{:<40} {:<10}".format("Failed requests:", result["failed"]))
    print("{:<40} {:<10.2f}".format("Benchmark duration (s):", result["duration"]))
    print("{:<40} {:<10}".format("Total input tokens:", result["total_input_tokens"]))
    print("{:<40} {:<10}".format("Total generated tokens:", result["total_output_tokens"]))
    print("{:<40} {:<10.2f}".format("Request throughput (req/s):", result["request_throughput"]))
    if result["request_goodput"] is not None:
        print("{:<40} {:<10.2f}".format("Request goodput (req/s):", result["request_goodput"]))
    print("{:<40} {:<10.2f}".format("Output token throughput (tok/s):", result["output_throughput"]))
    print("{:<40} {:<10.2f}".format("Total Token throughput (tok/s):",
                                    result["total_token_throughput"]))
    for key, name, header in METRICS:
        if key not in percentile_metrics:
            continue
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        print("{:<40} {:<10.2f}".format(f"Mean {name} (ms):", result[f"mean_{key}_ms"]))
        print("{:<40} {:<10.2f}".format(f"Median {name} (ms):", result[f"median_{key}_ms"]))
        for p in metric_percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            print("{:<40} {:<10.2f}".format(f"P{word} {name} (ms):", result[f"p{word}_{key}_ms"]))
        print("{:<40} {:<10.2f}".format(f"Max {name} (ms):", result[f"max_{key}_ms"]))
    server = result.get("server")
    if server:
        print("{s:{c}^{n}}".format(s="Server (its /metrics)", n=50, c="-"))
        print("{:<40} {:<10}".format("Engine steps:", server["steps"]))
        print("{:<40} {:<10}".format("Mixed prefill+decode steps:", server["mixed_steps"]))
        print("{:<40} {:<10}".format("Preemptions:", server["preemptions"]))
        if "overhead_e2el_ms" in server:
            print("{:<40} {:<10.2f}".format("Server overhead per request, TTFT (ms):",
                                            server["overhead_ttft_ms"]))
            print("{:<40} {:<10.2f}".format("Server overhead per request, E2EL (ms):",
                                            server["overhead_e2el_ms"]))
    print("=" * 50)


# --------------------------------------------------------------------------- runs

def run_mode(base_url, workload, intervals, rate, args, slos, tag, timeout=None) -> dict:
    """One run of the workload against the server at `base_url`, at `rate` requests per second;
    what is left after `timeout` seconds (default --timeout) is cancelled and counts as failed."""
    offsets = arrival_offsets(intervals, rate)
    records = [RequestRecord(f"{tag}-{i}", w["prompt_len"], w["output_len"], w["kind"], offsets[i])
               for i, w in enumerate(workload)]
    bodies = [request_body(args.endpoint, args.served_model, w["prompt_token_ids"], w.get("prompt_text", ""),
                           w["output_len"], args.ignore_eos) for w in workload]
    before = scrape_metrics(base_url)
    duration = asyncio.run(run_requests(base_url + args.endpoint, bodies, records,
                                        args.max_concurrency, args.timeout if timeout is None else timeout))
    result = compute_metrics(records, duration, slos, args.metric_percentiles)
    ok = [r for r in records if r.success]
    result["server"] = server_report(before, scrape_metrics(base_url), [r.ttft for r in ok],
                                     [r.latency for r in ok])
    result.update({"request_rate": rate, "burstiness": args.burstiness,
                   "max_concurrency": args.max_concurrency})
    return result


def warm_up(base_url: str, workload: list[dict], args: argparse.Namespace) -> None:
    """One short request, as vLLM's client sends before a run: it checks the server and keeps
    first-call costs out of the measurement."""
    first = dict(workload[0], output_len=min(4, workload[0]["output_len"]))
    probe = run_mode(base_url, [first], [0.0], math.inf, args, {}, "warmup")
    if probe["failed"]:
        raise SystemExit(f"the warm-up request failed: {probe['errors'][0]}")


def capacity_grid(args: argparse.Namespace) -> tuple[list[float], int]:
    """The rate grid all servers share, and the index of the rate each search starts from (the
    grid's rate nearest --start-rate)."""
    grid = serving_capacity.rate_grid(args.min_rate, args.max_rate, args.rate_steps)
    start = min(range(len(grid)), key=lambda i: abs(math.log(grid[i] / args.start_rate)))
    return grid, start


def probe_timeout(args: argparse.Namespace, offsets: list[float]) -> float:
    """Seconds after which a probe is cut short: its last arrival, then --ttft-slo-ms and
    PROBE_DRAIN_S for the last request to finish. A server that has not answered by then misses
    the TTFT bound anyway; cutting it short keeps an overloaded probe from draining for minutes."""
    if args.timeout is not None:
        return args.timeout
    return offsets[-1] + args.ttft_slo_ms / 1000 + PROBE_DRAIN_S


def capacity_search(base_url, workload_at, args, slos, spec: serving_capacity.ServerSpec) -> dict:
    """The server's capacity at each of its targets, on the rate grid all servers share;
    `workload_at(rate)` is the (workload, unit gaps) a probe at `rate` sends (the same on every
    server)."""
    grid, start = capacity_grid(args)
    targets = [serving_capacity.Slo(t, args.ttft_slo_ms, args.ttft_slo_percentile) for t in spec.itl_targets_ms]

    def run_at(rate: float) -> dict:
        workload, intervals = workload_at(rate)
        return run_mode(base_url, workload, intervals, rate, args, slos, f"{spec.name}-r{rate:g}",
                        timeout=probe_timeout(args, arrival_offsets(intervals, rate)))

    return serving_capacity.search_server(spec.name, grid, targets, run_at, start)


# --------------------------------------------------------------------------- plot

def plot(runs: dict[str, dict], path: str, title: str) -> str | None:
    """(a) per run, each request's timeline: waiting for its first token (queue and prefill), then
    decoding; (b) every inter-token latency over time, per run."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib to get one)")
        return None
    names = list(runs)
    fig, axes = plt.subplots(len(names) + 1, 1, figsize=(12, 3.2 * (len(names) + 1)),
                             constrained_layout=True)
    colors = {"chunked": "tab:blue", "unchunked": "tab:red"}
    for ax, name in zip(axes, names):
        res = runs[name]
        for i, (arrival, times, kind) in enumerate(zip(res["arrival_times"], res["token_times"], res["kinds"])):
            if not times:
                continue
            ax.plot([arrival, times[0]], [i, i], color="tab:orange", linewidth=2,
                    label="waiting for the first token" if i == 0 else None)
            ax.plot([times[0], times[-1]], [i, i], color="tab:green", linewidth=2,
                    label="decoding" if i == 0 else None)
            if kind == "long":
                ax.plot([arrival], [i], marker=">", color="black", markersize=5,
                        label="long prompt" if "long prompt" not in ax.get_legend_handles_labels()[1] else None)
        ax.set_xlabel("time since start (s)")
        ax.set_ylabel("request")
        server = res.get("server", {})
        ax.set_title(f"(a) {name}: each request's timeline ({server.get('steps', '?')} engine steps, "
                     f"{server.get('mixed_steps', '?')} mixed prefill+decode)")
        ax.legend(loc="upper left")
    ax = axes[-1]
    for name in names:
        res = runs[name]
        xs, ys = [], []
        for times in res["token_times"]:
            for a, b in zip(times, times[1:]):
                xs.append(b)
                ys.append(1000 * (b - a))
        ax.scatter(xs, ys, s=6, alpha=0.6, color=colors.get(name), label=(
            f"{name}: P99 {res.get('p99_itl_ms', 0):.0f} ms, max {max(ys or [0]):.0f} ms"))
    ax.set_yscale("log")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_title("(b) inter-token latency over time" + (", chunked vs unchunked" if len(names) > 1 else ""))
    ax.legend(loc="upper right")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- main

def result_name(args: argparse.Namespace) -> str:
    if args.compare_budgets:
        return "serving_capacity_targets"
    work = (os.path.splitext(os.path.basename(args.dataset_path))[0] if args.dataset_path
            else args.dataset_name)
    if args.capacity_search:
        what = "capacity-itl" + "-".join(f"{t:g}" for t in args.itl_slo_ms) + "ms"
    else:
        what = f"rate{args.request_rate:g}-b{args.burstiness:g}"
    mode = "compare" if args.compare_chunked else "server"
    return f"serving-{mode}-{work}-n{args.num_prompts}-{what}"


def server_flags(flags: list[str], chunked: bool) -> list[str]:
    """The engine flags for one of --compare-chunked's servers: chunking on or off; the
    unchunked server keeps its own token budget (a whole prompt must fit one step) and has no
    step latency target (it sizes chunks)."""
    dropped = () if chunked else serving_capacity.BUDGET_OPTIONS
    out = serving_capacity.drop_flags(flags, serving_capacity.BUDGET_SWITCHES, dropped)
    return out + ["--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill"]


def servers_to_measure(args: argparse.Namespace, extra_flags: list[str]) -> list[serving_capacity.ServerSpec]:
    """The servers this run starts (their engine flags), or the running one (no flags)."""
    targets = args.itl_slo_ms or []
    if args.compare_budgets:
        return serving_capacity.budget_servers(extra_flags, targets, args.compare_budgets)
    if args.compare_chunked:
        return [serving_capacity.ServerSpec(name, server_flags(extra_flags, name == "chunked"), targets)
                for name in ("chunked", "unchunked")]
    return [serving_capacity.ServerSpec("server", [], targets)]


def one_server(base_url, spec, workload, intervals, args, slos, runs, searches, workload_at=None) -> None:
    if args.model is None:  # the name the server answers to
        import httpx2
        args.served_model = httpx2.get(f"{base_url}/v1/models").json()["data"][0]["id"]
    warm_up(base_url, workload, args)
    if args.capacity_search:
        searches[spec.name] = capacity_search(base_url, workload_at, args, slos, spec)
    else:
        res = run_mode(base_url, workload, intervals, args.request_rate, args, slos, spec.name)
        runs[spec.name] = res
        print_result(res, f"Serving Benchmark Result ({spec.name})", args.metric_percentiles,
                     args.percentile_metrics)


def main(args: argparse.Namespace, extra_flags: list[str]) -> dict:
    print(args)
    random.seed(args.seed)
    slos = parse_goodput(args.goodput)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    args.served_model = args.model
    launch = args.compare_chunked or bool(args.compare_budgets)
    if args.model is None and not launch:  # the server's model gives the tokenizer
        import httpx2
        args.served_model = httpx2.get(f"{base_url}/v1/models").json()["data"][0]["id"]
    tokenizer = engine_setup.load_hf_tokenizer(args.served_model, args.tokenizer)
    workload = make_workload(args, tokenizer)
    if args.endpoint.endswith("chat/completions"):
        for w in workload:
            w["prompt_text"] = tokenizer.decode(w["prompt_token_ids"])
    intervals = unit_intervals(len(workload), args.burstiness, args.seed)
    kinds = sorted({r["kind"] for r in workload})
    counts = ", ".join(f"{k}: {sum(1 for r in workload if r['kind'] == k)}" for k in kinds)
    if not args.capacity_search:  # whose probes send workloads of their own (printed below)
        print(f"Workload: {len(workload)} requests ({counts}), "
              f"{sum(r['prompt_len'] for r in workload)} prompt tokens, "
              f"{sum(r['output_len'] for r in workload)} output tokens")
        print(f"Traffic request rate: {args.request_rate}")
    distribution = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
    print(f"Burstiness factor: {args.burstiness} ({distribution})")
    print(f"Maximum request concurrency: {args.max_concurrency}")

    runs: dict[str, dict] = {}
    searches: dict[str, dict] = {}
    servers: dict[str, dict] = {}
    specs = servers_to_measure(args, extra_flags)
    start = time.perf_counter()
    workload_at = None
    if args.capacity_search:
        grid, start_index = capacity_grid(args)
        chat = args.endpoint.endswith("chat/completions")
        workload_at = functools.cache(
            lambda rate: probe_workload(args, tokenizer, grid.index(rate), rate, chat))
        typical, upper = serving_capacity.estimate_seconds(
            specs, grid, lambda r: max(probe_size(args, r) / r, args.probe_seconds) + ESTIMATED_DRAIN_S,
            start_index, startup_s=ESTIMATED_STARTUP_S if launch else 0.0)
        print(f"Capacity search: {len(specs)} server(s), rates {', '.join(f'{r:.3g}' for r in grid)} req/s "
              f"from {grid[start_index]:.3g}; probes of {args.probe_seconds:g} s of arrivals (at least "
              f"{args.probe_min_prompts} requests, {args.long_fraction:.0%} long); estimated {typical / 60:.1f} min "
              f"if every server misses all targets by 4 req/s (at most {upper / 60:.1f} min)", flush=True)
    for done, spec in enumerate(specs, 1):
        if not launch:
            one_server(base_url, spec, workload, intervals, args, slos, runs, searches, workload_at)
            continue
        log_path = server_log_path(args, spec.name)
        with LaunchedServer(args.model, spec.flags, log_path=log_path) as server:
            servers[spec.name] = {"flags": spec.flags, "startup_seconds": server.startup_seconds,
                                  "log": log_path}
            print(f"[{spec.name}] `vllm serve` up in {server.startup_seconds:.1f} s at {server.base_url}")
            one_server(server.base_url, spec, workload, intervals, args, slos, runs, searches, workload_at)
        elapsed = time.perf_counter() - start
        print(f"[{spec.name}] done, {elapsed / 60:.1f} min since the start, about "
              f"{elapsed / done * (len(specs) - done) / 60:.1f} min to go", flush=True)

    results: dict = {}
    if runs:
        results.update(runs[next(iter(runs))])
    results.update({
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": "vllm",
        "endpoint": args.endpoint,
        "model_id": args.served_model,
        "num_prompts": len(workload),
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "workload": {"dataset_path": args.dataset_path,
                     "dataset_name": args.dataset_name if not args.dataset_path else None,
                     "num_long": sum(1 for r in workload if r["kind"] == "long"),
                     "total_prompt_tokens": sum(r["prompt_len"] for r in workload),
                     "total_output_tokens": sum(r["output_len"] for r in workload)},
        "servers": servers,
        "runs": runs,
        "args": result_files.args_dict(args),
        "server_flags": extra_flags,
        "machine": result_files.machine_info(),
    })
    if searches:
        grid, start_index = capacity_grid(args)
        results["capacity_search"] = {
            "itl_slo_ms": args.itl_slo_ms, "ttft_slo_ms": args.ttft_slo_ms,
            "ttft_slo_percentile": args.ttft_slo_percentile,
            "rate_grid": grid, "start_rate": grid[start_index],
            "probe_workload": probe_definition(args, {p["request_rate"]: workload_at(p["request_rate"])[0]
                                                      for found in searches.values() for p in found["probes"]}),
            "wall_seconds": time.perf_counter() - start, "servers": searches}
    if args.compare_budgets:
        rows = serving_capacity.compare(specs, searches)
        results["capacity_by_target"] = rows
        print("{s:{c}^{n}}".format(s=" capacity (req/s): latency target vs fixed budgets ", n=72, c="="))
        print(serving_capacity.format_table(rows, args.min_rate))
    if len(runs) == 2:
        c, u = runs["chunked"], runs["unchunked"]
        # Chunking splits one long stall of the decodes into several short ones: the worst gaps
        # shrink while more gaps are slowed, so the tail shows at the percentiles asked for and
        # at the maximum.
        itl_tail = [f"p{str(int(p)) if int(p) == p else str(p)}_itl_ms" for p in args.metric_percentiles]
        keys = ("median_itl_ms", *itl_tail, "max_itl_ms", "mean_ttft_ms", "p99_ttft_ms", "mean_e2el_ms",
                "request_throughput", "output_throughput")
        results["comparison"] = {k: {"chunked": c[k], "unchunked": u[k]} for k in keys}
        print("{s:{c}^{n}}".format(s=" chunked vs unchunked ", n=50, c="="))
        for k in keys:
            print(f"{k:<28} {c[k]:>10.2f} {u[k]:>10.2f}")
        print("=" * 50)

    if args.save_result or args.output_json:
        path = result_files.write_json(results, output_path(args))
        print(f"Results written to {path}")
        if runs and not args.no_plot:
            png = args.plot or os.path.splitext(str(path))[0] + ".png"
            title = (f"{len(workload)} requests over HTTP, rate {args.request_rate} req/s, "
                     f"burstiness {args.burstiness}")
            if plot(runs, png, title):
                print(f"Plot written to {png}")
    return results


def server_log_path(args: argparse.Namespace, name: str) -> str:
    """Beside the results when they are saved, else in the temporary directory."""
    if args.save_result or args.output_json:
        base = os.path.splitext(output_path(args))[0]
        os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
    else:
        base = os.path.join(tempfile.gettempdir(), f"benchmark_serving-{os.getpid()}")
    return f"{base}-{name}-server.log"


def output_path(args: argparse.Namespace) -> str:
    if args.output_json:
        return args.output_json
    if args.result_filename:
        return os.path.join(args.result_dir or str(result_files.RESULTS_DIR), args.result_filename)
    return str(result_files.default_result_path(result_name(args)) if not args.result_dir
               else os.path.join(args.result_dir, result_name(args) + ".json"))


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    s = parser.add_argument_group("server")
    s.add_argument("--base-url", type=str, default=None, help="e.g. http://127.0.0.1:8000")
    s.add_argument("--host", type=str, default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--endpoint", type=str, default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    s.add_argument("--model", type=str, default=None,
                   help="the model name in requests, its tokenizer, and what --compare-chunked serves "
                        "(default: the server's first model; SmolLM2 for --compare-chunked)")
    s.add_argument("--tokenizer", type=str, default=None, help="tokenizer directory (default: --model's)")
    w = parser.add_argument_group("workload")
    w.add_argument("--dataset-name", choices=["mixed", "random", "sharegpt"], default="mixed")
    w.add_argument("--dataset-path", "--dataset", dest="dataset_path", type=str, default=None,
                   help="ShareGPT JSON, or JSON/JSONL records")
    w.add_argument("--num-prompts", type=int, default=24)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--short-input-len", type=parse_range, default=(16, 128), metavar="A:B")
    w.add_argument("--long-input-len", type=parse_range, default=(1500, 2000), metavar="A:B")
    w.add_argument("--output-len-range", type=parse_range, default=(32, 128), metavar="A:B")
    w.add_argument("--long-fraction", type=float, default=None,
                   help="mixed: the share of long prompts (default 0.1; 0.25 with --capacity-search, "
                        "so that the long prefills' stalls reach the P99 of the gaps)")
    w.add_argument("--random-input-len", type=int, default=1024)
    w.add_argument("--random-output-len", type=int, default=128)
    w.add_argument("--random-range-ratio", type=float, default=0.0)
    w.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the requested output length (default on)")
    a = parser.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=float, default=1.0,
                   help="requests per second; inf sends all at time 0 (vLLM's default is inf)")
    a.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times; 1 = Poisson")
    a.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    a.add_argument("--timeout", type=float, default=None,
                   help="cancel what is left after this many seconds of one run")
    m = parser.add_argument_group("metrics and modes")
    m.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:2000 tpot:200 e2el:20000 (milliseconds)")
    m.add_argument("--percentile-metrics", type=lambda s: s.split(","), default=["ttft", "tpot", "itl"],
                   help="comma-separated metrics to print percentiles of (ttft,tpot,itl,e2el)")
    m.add_argument("--metric-percentiles", type=lambda s: [float(x) for x in s.split(",")],
                   default=[99.0], help="comma-separated percentiles to report (default 99)")
    m.add_argument("--compare-chunked", action="store_true",
                   help="start `vllm serve` with chunked prefill on, then off, and run on each")
    m.add_argument("--capacity-search", action="store_true",
                   help="per server and --itl-slo-ms target, the highest request rate whose P99 ITL "
                        "meets the target and whose TTFT meets --ttft-slo-ms")
    m.add_argument("--itl-slo-ms", type=float, nargs="+", default=None, metavar="MS",
                   help="capacity search: P99 inter-token latency targets")
    m.add_argument("--ttft-slo-ms", type=float, default=10000.0,
                   help="capacity search: a rate also needs its TTFT (queueing included) at "
                        "--ttft-slo-percentile under this bound, so an overloaded server does not "
                        "count (default 10000)")
    m.add_argument("--ttft-slo-percentile", type=float, default=99.0,
                   help="capacity search: the TTFT percentile --ttft-slo-ms bounds (default 99)")
    m.add_argument("--compare-budgets", type=int, nargs="+", default=None, metavar="TOKENS",
                   help="capacity search: start one server per --itl-slo-ms target with "
                        "--max-step-latency-ms at that target (the largest budget the upper bound) "
                        "and one per fixed --max-num-batched-tokens budget, and compare them")
    m.add_argument("--min-rate", type=float, default=0.25, help="capacity search: lowest rate, req/s (default 0.25)")
    m.add_argument("--max-rate", type=float, default=16.0, help="capacity search: highest rate, req/s (default 16)")
    m.add_argument("--rate-steps", type=int, default=13,
                   help="capacity search: rates in the geometric grid from --min-rate to --max-rate "
                        "(default 13: each sqrt(2) times the previous)")
    m.add_argument("--start-rate", type=float, default=1.0,
                   help="capacity search: the rate each server is probed at first (the nearest grid "
                        "rate; default 1)")
    m.add_argument("--probe-seconds", type=float, default=24.0,
                   help="capacity search: each probe sends rate x this many seconds of requests (default 24)")
    m.add_argument("--probe-min-prompts", type=int, default=16,
                   help="capacity search: each probe sends at least this many requests (default 16)")
    o = parser.add_argument_group("output")
    o.add_argument("--save-result", action="store_true", help="write the JSON (and the PNG)")
    o.add_argument("--result-dir", type=str, default=None, help="default benchmarks/results/")
    o.add_argument("--result-filename", type=str, default=None)
    o.add_argument("--output-json", type=str, default=None, help="result path (implies --save-result)")
    o.add_argument("--plot", type=str, default=None, help="PNG path (default: beside the JSON)")
    o.add_argument("--no-plot", action="store_true")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> None:
    if extra and not (args.compare_chunked or args.compare_budgets):
        parser.error(f"unrecognized arguments: {' '.join(extra)} (engine flags go to the servers "
                     "--compare-chunked or --compare-budgets starts)")
    if args.num_prompts < 1:
        parser.error("--num-prompts must be at least 1")
    if not args.request_rate > 0:
        parser.error("--request-rate must be > 0 (inf for all at once)")
    if not args.burstiness > 0:
        parser.error("--burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be at least 1")
    if args.long_fraction is None:
        args.long_fraction = 0.25 if args.capacity_search else 0.1
    if not 0 <= args.long_fraction <= 1:
        parser.error("--long-fraction must be in [0, 1]")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        parser.error("--dataset-name sharegpt needs --dataset-path")
    unknown = sorted(set(args.percentile_metrics) - {key for key, _, _ in METRICS})
    if unknown:
        parser.error(f"--percentile-metrics: unknown {unknown}; choose from ttft,tpot,itl,e2el")
    if args.capacity_search:
        if not args.itl_slo_ms or min(args.itl_slo_ms) <= 0:
            parser.error("--capacity-search needs --itl-slo-ms, each target > 0")
        if not 0 < args.min_rate < args.max_rate or math.isinf(args.max_rate):
            parser.error("--capacity-search needs 0 < --min-rate < --max-rate < inf")
        if args.rate_steps < 2:
            parser.error("--rate-steps must be at least 2")
        if not args.min_rate <= args.start_rate <= args.max_rate:
            parser.error("--start-rate must be within --min-rate .. --max-rate")
        if not args.probe_seconds > 0 or args.probe_min_prompts < 1:
            parser.error("--probe-seconds must be > 0 and --probe-min-prompts at least 1")
        if not args.ttft_slo_ms > 0 or not 0 < args.ttft_slo_percentile <= 100:
            parser.error("--ttft-slo-ms must be > 0 and --ttft-slo-percentile in (0, 100]")
    if args.compare_budgets:
        if not args.capacity_search or args.compare_chunked:
            parser.error("--compare-budgets goes with --capacity-search, without --compare-chunked")
        if min(args.compare_budgets) < 1:
            parser.error("--compare-budgets: each budget must be at least 1 token")
        sized = [f for f in extra if f.split("=", 1)[0] in serving_capacity.BUDGET_OPTIONS]
        if sized:
            parser.error(f"--compare-budgets sets each server's {' and '.join(serving_capacity.BUDGET_OPTIONS)}; "
                         f"drop {' '.join(sized)}")
    try:
        parse_goodput(args.goodput)
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    _parser = make_parser()
    _args, _extra = _parser.parse_known_args()
    check_args(_parser, _args, _extra)
    main(_args, _extra)
