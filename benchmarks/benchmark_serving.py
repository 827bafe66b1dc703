"""Online serving, replayed in process: an arrival process against the `LLMEngine` step loop.

No HTTP server: requests are added to `llm.llm_engine` when their arrival time has passed (the
clock is checked between steps, as a server's engine loop would), and every token's time is taken
from the outputs `step()` returns. Metrics follow vLLM's benchmark_serving:
  TTFT  time to first token, from the request's scheduled arrival (queueing included)
  TPOT  (E2E latency - TTFT) / (output tokens - 1), per request
  ITL   every gap between consecutive tokens of a request
  E2EL  end-to-end latency, arrival to last token
each as mean / median / std / P99 (--metric-percentiles), plus request and token throughput and
goodput: requests per second that meet every SLO of --goodput (vLLM's "KEY:VALUE" syntax, keys
ttft, tpot, e2el, values in milliseconds, e.g. --goodput ttft:2000 tpot:200).

Arrivals (vLLM's rule): inter-arrival times are gamma distributed with shape = --burstiness and
mean 1 / --request-rate (burstiness 1 = a Poisson process; < 1 burstier, > 1 more regular);
--request-rate inf sends every request at time 0.

Workloads (--dataset-name, seeded by --seed; prompts are random non-special token ids):
  mixed (default)  chat-like traffic with a few long documents: a fraction --long-fraction
                   (default 0.1, at least one request) of the --num-prompts requests have
                   --long-input-len (default 1500:2000) prompt tokens, the rest --short-input-len
                   (default 16:128); every request generates --output-len-range (default 32:128)
                   tokens. Lengths are uniform in each inclusive A:B range; the long requests sit
                   at random positions in the arrival order (never first).
  random           vLLM's random dataset: --random-input-len / --random-output-len, each length
                   uniform in [len * (1 - --random-range-ratio), len * (1 + ratio)].
  --dataset FILE   JSON/JSONL records {"prompt": text | "prompt_token_ids": [...], "output_len": N}
                   (see benchmark_throughput.py); the first --num-prompts records, in order.
Outputs are greedy (temperature 0, as vLLM's client sends) with exactly the requested length
(ignore_eos) unless --no-ignore-eos.

Modes:
  default            one run with the engine flags given (chunked prefill on unless
                     --no-enable-chunked-prefill)
  --compare-chunked  the same workload and arrival times with chunked prefill on, then off, each
                     on a fresh engine (the unchunked engine keeps its own default token budget,
                     max(max_model_len, 2048), since a whole prompt must fit in one step)
  --capacity-search --itl-slo-ms X
                     bisects the request rate for the highest one whose P99 ITL <= X ms and
                     median TTFT <= --max-median-ttft-ms (default 2000: past it requests queue),
                     in at most --max-probes runs of the workload (same requests, arrival gaps
                     scaled by 1/rate) between --min-rate and --max-rate; per mode with
                     --compare-chunked

Results: JSON (vLLM's keys: duration, completed, total_input_tokens, total_output_tokens,
request_throughput, "request_goodput:", output_throughput, total_token_throughput,
mean/median/std/p99 _ttft/_tpot/_itl/_e2el _ms, ttfts, itls, ...) with every run under "runs",
written to --output-json or benchmarks/results/<name>.json; and, if matplotlib is importable, a
PNG beside it (or --plot PATH) with (a) the prefill/decode tokens of every step and (b) the
inter-token latencies over time, chunked vs unchunked.

    python benchmarks/benchmark_serving.py --compare-chunked
    python benchmarks/benchmark_serving.py --request-rate 2 --burstiness 0.5 --goodput ttft:3000 tpot:300
    python benchmarks/benchmark_serving.py --capacity-search --itl-slo-ms 500 --num-prompts 24
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

GOODPUT_KEYS = ("ttft", "tpot", "e2el")
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


def make_workload(args: argparse.Namespace, tokenizer) -> list[dict]:
    """[{"prompt_token_ids", "prompt_len", "output_len", "kind"}] in arrival order."""
    if args.dataset is not None:
        reqs = common.load_dataset(args.dataset, tokenizer, args.num_prompts)
        for r in reqs:
            r["kind"] = "dataset"
        return reqs
    vocab, special = common.tokenizer_vocab(tokenizer)
    rng = random.Random(args.seed)
    n = args.num_prompts
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
    return [{"prompt_token_ids": common.random_token_ids(rng, p, vocab, special), "prompt_len": p,
             "output_len": o, "kind": kind} for p, o, kind in specs]


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


# --------------------------------------------------------------------------- replay

@dataclass
class RequestRecord:
    request_id: str
    prompt_len: int
    expected_output_len: int
    kind: str
    arrival: float                      # scheduled arrival, seconds after the run's start
    token_times: list[float] = field(default_factory=list)  # seconds after the start
    finish: float | None = None
    error: str | None = None
    generated_text: str = ""

    @property
    def success(self) -> bool:
        return self.error is None and self.finish is not None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def latency(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def replay(llm, workload: list[dict], offsets: list[float], args: argparse.Namespace,
           tag: str) -> dict:
    """Runs the workload against the engine; returns the records, the steps and the duration."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    recorder = common.StepRecorder(engine)
    records: dict[str, RequestRecord] = {}
    seen_tokens: dict[str, int] = {}
    order = sorted(range(len(workload)), key=lambda i: offsets[i])
    nxt = 0
    before = common.stats_snapshot(engine)
    start = time.monotonic()  # the engine's clock (arrival_time)
    perf_start = time.perf_counter()  # StepRecorder's clock
    deadline = start + args.timeout if args.timeout else None
    timed_out = False
    while nxt < len(order) or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while nxt < len(order) and offsets[order[nxt]] <= now:
            i = order[nxt]
            nxt += 1
            req = workload[i]
            rid = f"{tag}-{i}"
            records[rid] = RequestRecord(rid, req["prompt_len"], req["output_len"], req["kind"],
                                         offsets[i])
            seen_tokens[rid] = 0
            params = SamplingParams(temperature=0.0, max_tokens=req["output_len"],
                                    ignore_eos=args.ignore_eos)
            engine.add_request(rid, {"prompt_token_ids": req["prompt_token_ids"]}, params,
                               arrival_time=start + offsets[i])
        if deadline is not None and time.monotonic() > deadline:
            timed_out = True
            unfinished = [rid for rid, r in records.items() if r.finish is None and r.error is None]
            engine.abort_request(unfinished)
            for rid in unfinished:
                records[rid].error = "timeout"
            for i in order[nxt:]:
                rid = f"{tag}-{i}"
                records[rid] = RequestRecord(rid, workload[i]["prompt_len"], workload[i]["output_len"],
                                             workload[i]["kind"], offsets[i], error="timeout")
            while engine.has_unfinished_requests():  # drain aborted requests, if any linger
                if not engine.step():
                    break
            break
        if not engine.has_unfinished_requests():
            if nxt < len(order):
                time.sleep(max(0.0, offsets[order[nxt]] - (time.monotonic() - start)))
            continue
        outputs = recorder.step()
        t = time.monotonic() - start
        for out in outputs:
            rec = records.get(out.request_id)
            if rec is None:
                continue
            n = len(out.outputs[0].token_ids)
            rec.token_times += [t] * max(0, n - seen_tokens[out.request_id])
            seen_tokens[out.request_id] = max(n, seen_tokens[out.request_id])
            if getattr(out, "error", None):
                rec.error = out.error
            if out.finished:
                rec.finish = t
                rec.generated_text = out.outputs[0].text
                if not rec.token_times and rec.error is None:
                    rec.error = f"finished without tokens ({out.outputs[0].finish_reason})"
    duration = time.monotonic() - start
    # Requests the engine refused at add_request are reported by the next step() call.
    for out in engine.step():
        rec = records.get(out.request_id)
        if rec is not None and rec.finish is None:
            rec.error = getattr(out, "error", None) or "finished without tokens"
    for rec in records.values():
        if rec.finish is None and rec.error is None:
            rec.error = "not finished"
    stats = common.stats_diff(before, common.stats_snapshot(engine))
    steps = [{"t": r.start - perf_start, "seconds": r.seconds,
              "prefill_tokens": r.prefill_tokens, "decode_tokens": r.decode_tokens}
             for r in recorder.records]
    ordered = [records[f"{tag}-{i}"] for i in range(len(workload)) if f"{tag}-{i}" in records]
    return {"records": ordered, "duration": duration, "steps": steps, "engine_stats": stats,
            "step_records": recorder.records, "timed_out": timed_out}


def warm_up(llm) -> None:
    """Two short requests through the step loop, so first-call costs stay out of the run."""
    from vllm import SamplingParams
    vocab, special = common.tokenizer_vocab(llm.get_tokenizer())
    rng = random.Random(12345)
    prompts = [{"prompt_token_ids": common.random_token_ids(rng, 16, vocab, special)} for _ in range(2)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)


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
        n = len(r.token_times)
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
    total_output = sum(len(r.token_times) for r in ok)
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
        "output_lens": [len(r.token_times) if r.success else 0 for r in records],
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


def print_result(result: dict, title: str, metric_percentiles: list[float]) -> None:
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
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        print("{:<40} {:<10.2f}".format(f"Mean {name} (ms):", result[f"mean_{key}_ms"]))
        print("{:<40} {:<10.2f}".format(f"Median {name} (ms):", result[f"median_{key}_ms"]))
        for p in metric_percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            print("{:<40} {:<10.2f}".format(f"P{word} {name} (ms):", result[f"p{word}_{key}_ms"]))
    stats = result.get("engine_stats")
    if stats:
        print("{s:{c}^{n}}".format(s="Engine steps", n=50, c="-"))
        print("{:<40} {:<10}".format("Steps:", stats["num_steps"]))
        print("{:<40} {:<10}".format("Mixed prefill+decode steps:", stats["num_mixed_steps"]))
        print("{:<40} {:<10}".format("Prefill / decode tokens:",
                                     f"{stats['num_prefill_tokens']} / {stats['num_decode_tokens']}"))
        print("{:<40} {:<10}".format("Preemptions:", stats["num_preemptions"]))
    print("=" * 50)


# --------------------------------------------------------------------------- runs

def build_engine(args: argparse.Namespace, chunked: bool, compare: bool):
    kwargs = common.engine_kwargs(args, enable_chunked_prefill=chunked)
    if compare and not chunked:
        kwargs.pop("max_num_batched_tokens", None)
    from vllm import LLM
    model = kwargs.pop("model")
    t0 = time.perf_counter()
    llm = LLM(model, **kwargs)
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm_up(llm)
    return llm, init_s, time.perf_counter() - t0


def run_mode(llm, workload, intervals, rate, args, slos, tag) -> dict:
    offsets = arrival_offsets(intervals, rate)
    out = replay(llm, workload, offsets, args, tag)
    result = compute_metrics(out["records"], out["duration"], slos, args.metric_percentiles)
    result.update({"request_rate": rate, "burstiness": args.burstiness,
                   "engine_stats": out["engine_stats"], "steps": out["steps"],
                   "timed_out": out["timed_out"]})
    result["_step_records"] = out["step_records"]
    return result


def capacity_search(llm, workload, intervals, args, slos, label) -> dict:
    """Bisection on the rate: the highest probed rate whose P99 ITL meets --itl-slo-ms while the
    median TTFT stays under --max-median-ttft-ms. The second bound is what makes it a capacity:
    past it, requests queue faster than they are served, which shows in the time to first token
    (queueing included) and not in the gaps between tokens. Sarathi-Serve bounds the median
    scheduling delay the same way."""
    probes: list[dict] = []

    def probe(rate: float) -> bool:
        res = run_mode(llm, workload, intervals, rate, args, slos, f"{label}-r{len(probes)}")
        itl99 = _p99_itl(res)
        ok = (itl99 <= args.itl_slo_ms and res["median_ttft_ms"] <= args.max_median_ttft_ms
              and not res["failed"])
        probes.append({"request_rate": rate, "p99_itl_ms": itl99, "meets_slo": ok,
                       "completed": res["completed"], "failed": res["failed"],
                       "duration": res["duration"], "request_throughput": res["request_throughput"],
                       "output_throughput": res["output_throughput"],
                       "mean_ttft_ms": res["mean_ttft_ms"], "median_ttft_ms": res["median_ttft_ms"],
                       "median_itl_ms": res["median_itl_ms"]})
        print(f"[{label}] probe {len(probes)}/{args.max_probes}: rate {rate:.3f} req/s -> "
              f"P99 ITL {itl99:.1f} ms, median TTFT {res['median_ttft_ms']:.0f} ms "
              f"({'meets' if ok else 'misses'} {args.itl_slo_ms} / {args.max_median_ttft_ms} ms), "
              f"{res['request_throughput']:.2f} req/s served", flush=True)
        return ok

    lo, hi = args.min_rate, args.max_rate
    best = None
    if probe(hi):
        best = hi
    elif len(probes) < args.max_probes and probe(lo):
        best = lo
        # invariant: lo meets the SLO, hi misses it
        while len(probes) < args.max_probes:
            mid = math.sqrt(lo * hi) if args.geometric_search else (lo + hi) / 2
            if probe(mid):
                lo = best = mid
            else:
                hi = mid
    return {"capacity_rate": best, "itl_slo_ms": args.itl_slo_ms,
            "max_median_ttft_ms": args.max_median_ttft_ms, "probes": probes,
            "bracket": [lo, hi], "note": None if best is not None else
            f"even --min-rate {args.min_rate} misses the SLO"}


def _p99_itl(res: dict) -> float:
    import numpy as np
    gaps = [g for r in res["itls"] for g in r]
    return float(np.percentile(gaps, 99) * 1000) if gaps else 0.0


# --------------------------------------------------------------------------- plot

def plot(runs: dict[str, dict], path: str, title: str) -> str | None:
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
        steps = runs[name]["steps"]
        x = list(range(len(steps)))
        dec = [s["decode_tokens"] for s in steps]
        pre = [s["prefill_tokens"] for s in steps]
        top = [d + p for d, p in zip(dec, pre)]
        ax.fill_between(x, 0, dec, step="mid", color="tab:green", linewidth=0, label="decode tokens")
        ax.fill_between(x, dec, top, step="mid", color="tab:orange", linewidth=0,
                        label="prefill tokens")
        ax.set_xlim(-0.5, max(len(steps), 1) - 0.5)
        ax.set_ylim(0, max(top or [1]) * 1.1)
        ax.set_xlabel("engine step")
        ax.set_ylabel("tokens in step")
        mixed = sum(1 for s in steps if s["prefill_tokens"] and s["decode_tokens"])
        ax.set_title(f"(a) {name}: prefill and decode tokens of each step "
                     f"({len(steps)} steps, {mixed} mixed prefill+decode)")
        ax.legend(loc="upper right")
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
    work = (os.path.splitext(os.path.basename(args.dataset))[0] if args.dataset
            else args.dataset_name)
    if args.capacity_search:
        what = f"capacity-itl{args.itl_slo_ms:g}ms"
    else:
        what = f"rate{args.request_rate:g}-b{args.burstiness:g}"
    mode = ("compare" if args.compare_chunked
            else "chunked" if args.enable_chunked_prefill else "unchunked")
    return f"serving-{mode}-{work}-n{args.num_prompts}-{what}"


def main(args: argparse.Namespace) -> dict:
    print(args)
    common.apply_threads(args)
    random.seed(args.seed)
    slos = parse_goodput(args.goodput)

    tokenizer = common.load_hf_tokenizer(args.model, args.tokenizer)
    workload = make_workload(args, tokenizer)
    intervals = unit_intervals(len(workload), args.burstiness, args.seed)
    modes = [True, False] if args.compare_chunked else [args.enable_chunked_prefill]
    kinds = sorted({r["kind"] for r in workload})
    counts = ", ".join(f"{k}: {sum(1 for r in workload if r['kind'] == k)}" for k in kinds)
    print(f"Workload: {len(workload)} requests ({counts}), "
          f"{sum(r['prompt_len'] for r in workload)} prompt tokens, "
          f"{sum(r['output_len'] for r in workload)} output tokens")
    distribution = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
    print(f"Traffic request rate: {args.request_rate}")
    print(f"Burstiness factor: {args.burstiness} ({distribution})")

    runs: dict[str, dict] = {}
    searches: dict[str, dict] = {}
    engines: dict[str, dict] = {}
    step_records: dict[str, list] = {}
    for chunked in modes:
        name = "chunked" if chunked else "unchunked"
        gc.collect()
        llm, init_s, warm_s = build_engine(args, chunked, args.compare_chunked)
        engines[name] = {"init_seconds": init_s, "warmup_seconds": warm_s,
                         "dtype": common.engine_dtype_name(llm, args.dtype)}
        if args.capacity_search:
            searches[name] = capacity_search(llm, workload, intervals, args, slos, name)
            cap = searches[name]["capacity_rate"]
            print(f"[{name}] capacity at P99 ITL <= {args.itl_slo_ms} ms: "
                  + (f"{cap:.3f} req/s" if cap is not None else "none found")
                  + f" ({len(searches[name]['probes'])} probes)")
        else:
            res = run_mode(llm, workload, intervals, args.request_rate, args, slos, name)
            step_records[name] = res.pop("_step_records")
            res["enable_chunked_prefill"] = chunked
            runs[name] = res
            print_result(res, f"Serving Benchmark Result ({name} prefill)", args.metric_percentiles)
        del llm
        gc.collect()

    results: dict = {}
    if runs:
        primary = runs[next(iter(runs))]
        results.update({k: v for k, v in primary.items() if k not in ("steps",)})
    results.update({
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": "vllm-inprocess",
        "model_id": common.resolve_model_path(args.model),
        "num_prompts": len(workload),
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "workload": {"dataset": args.dataset, "dataset_name": args.dataset_name if not args.dataset else None,
                     "num_long": sum(1 for r in workload if r["kind"] == "long"),
                     "total_prompt_tokens": sum(r["prompt_len"] for r in workload),
                     "total_output_tokens": sum(r["output_len"] for r in workload)},
        "engines": engines,
        "runs": runs,
        "args": common.args_dict(args),
        "machine": common.machine_info(),
    })
    if searches:
        results["capacity_search"] = searches
    if len(runs) == 2:
        c, u = runs["chunked"], runs["unchunked"]
        keys = ("p99_itl_ms", "median_itl_ms", "mean_ttft_ms", "p99_ttft_ms", "mean_e2el_ms",
                "request_throughput", "output_throughput")
        results["comparison"] = {k: {"chunked": c[k], "unchunked": u[k]} for k in keys}
        print("{s:{c}^{n}}".format(s=" chunked vs unchunked ", n=50, c="="))
        for k in keys:
            print("{:<28} {:>10.2f} {:>10.2f}".format(k, c[k], u[k]))
        print("=" * 50)

    path = args.output_json or common.default_result_path(result_name(args))
    path = common.write_json(results, path)
    print(f"Results written to {path}")
    if runs and not args.no_plot:
        png = args.plot or os.path.splitext(str(path))[0] + ".png"
        title = (f"{len(workload)} requests, rate {args.request_rate} req/s, "
                 f"burstiness {args.burstiness}")
        if plot(runs, png, title):
            print(f"Plot written to {png}")
    return results


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    w = parser.add_argument_group("workload")
    w.add_argument("--dataset-name", choices=["mixed", "random"], default="mixed")
    w.add_argument("--dataset", type=str, default=None, help="JSON/JSONL workload file")
    w.add_argument("--num-prompts", type=int, default=24)
    w.add_argument("--short-input-len", type=parse_range, default=(16, 128), metavar="A:B")
    w.add_argument("--long-input-len", type=parse_range, default=(1500, 2000), metavar="A:B")
    w.add_argument("--output-len-range", type=parse_range, default=(32, 128), metavar="A:B")
    w.add_argument("--long-fraction", type=float, default=0.1)
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
    a.add_argument("--timeout", type=float, default=None,
                   help="abort what is left after this many seconds of one run")
    m = parser.add_argument_group("metrics and modes")
    m.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:2000 tpot:200 e2el:20000 (milliseconds)")
    m.add_argument("--metric-percentiles", type=lambda s: [float(x) for x in s.split(",")],
                   default=[99.0], help="comma-separated percentiles to report (default 99)")
    m.add_argument("--compare-chunked", action="store_true",
                   help="run the workload with chunked prefill on and off (fresh engine each)")
    m.add_argument("--capacity-search", action="store_true",
                   help="find the highest request rate whose P99 ITL meets --itl-slo-ms")
    m.add_argument("--itl-slo-ms", type=float, default=None)
    m.add_argument("--max-median-ttft-ms", type=float, default=2000.0,
                   help="capacity search: a rate also needs its median TTFT (queueing included) "
                        "under this bound, so an overloaded engine does not count (default 2000)")
    m.add_argument("--min-rate", type=float, default=0.25)
    m.add_argument("--max-rate", type=float, default=8.0)
    m.add_argument("--max-probes", type=int, default=6)
    m.add_argument("--geometric-search", action=argparse.BooleanOptionalAction, default=True,
                   help="bisect rates geometrically (default) or arithmetically")
    o = parser.add_argument_group("output")
    o.add_argument("--output-json", type=str, default=None,
                   help="result path (default benchmarks/results/<name>.json)")
    o.add_argument("--plot", type=str, default=None, help="PNG path (default: beside the JSON)")
    o.add_argument("--no-plot", action="store_true")
    common.add_engine_args(parser)
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        parser.error("--num-prompts must be at least 1")
    if not args.request_rate > 0:
        parser.error("--request-rate must be > 0 (inf for all at once)")
    if not args.burstiness > 0:
        parser.error("--burstiness must be > 0")
    if not 0 <= args.long_fraction <= 1:
        parser.error("--long-fraction must be in [0, 1]")
    if args.capacity_search:
        if args.itl_slo_ms is None:
            parser.error("--capacity-search needs --itl-slo-ms")
        if not 0 < args.min_rate < args.max_rate or math.isinf(args.max_rate):
            parser.error("--capacity-search needs 0 < --min-rate < --max-rate < inf")
        if args.max_probes < 1:
            parser.error("--max-probes must be at least 1")
    try:
        parse_goodput(args.goodput)
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    _parser = make_parser()
    _args = _parser.parse_args()
    check_args(_parser, _args)
    main(_args)
