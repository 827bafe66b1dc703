"""Serving capacity, Sarathi-Serve's metric, for benchmark_serving.py --capacity-search.

The capacity of a server at a time-between-tokens target T is the highest request rate whose
P99 inter-token latency (ITL) is at most T while the TTFT at --ttft-slo-percentile (queueing
included) stays under --ttft-slo-ms: past that rate requests queue faster than they are served,
which shows in the time to first token and not in the gaps between tokens.

Rates come from a geometric grid (--min-rate .. --max-rate, --rate-steps points). A probe is one
run of the workload at one rate against one server; its result is cached per server, and each
target bisects the grid over the cached probes: a probe's verdict for every target is read from
the same run, so a server judged against three targets runs each rate at most once.

--compare-budgets B1 B2 ... starts the servers itself: one per target with
`--max-step-latency-ms T` (the largest budget as `--max-num-batched-tokens`, the upper bound),
judged against its own target, and one per fixed budget `--max-num-batched-tokens B`, judged
against every target. Per target the verdict is whether the latency target's capacity is at least
the best fixed budget's. Nothing here starts a server or sends a request: benchmark_serving.py
passes in the function that runs a probe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

# Engine flags that size the step; --compare-budgets sets them per server.
BUDGET_SWITCHES = ("--enable-chunked-prefill", "--no-enable-chunked-prefill")
BUDGET_OPTIONS = ("--max-num-batched-tokens", "--max-step-latency-ms")


@dataclass(frozen=True)
class Slo:
    """Service level objectives of one capacity: P99 ITL and a TTFT percentile, milliseconds."""

    itl_ms: float
    ttft_ms: float
    ttft_percentile: float = 99.0


@dataclass(frozen=True)
class Probe:
    """What the SLOs read of one run at one rate; `details` holds the run's other metrics."""

    request_rate: float
    p99_itl_ms: float
    ttft_ms: float  # the TTFT at the SLO's percentile, queueing included
    failed: int = 0
    details: dict = field(default_factory=dict, compare=False)

    def meets(self, slo: Slo) -> bool:
        return self.failed == 0 and self.p99_itl_ms <= slo.itl_ms and self.ttft_ms <= slo.ttft_ms


@dataclass
class ServerSpec:
    """A server to measure: its engine flags, and the ITL targets its probes are judged against."""

    name: str
    flags: list[str]
    itl_targets_ms: list[float]
    budget: int | None = None           # the fixed budget it stands for
    step_latency_ms: float | None = None  # the latency target it runs with


def rate_grid(min_rate: float, max_rate: float, steps: int) -> list[float]:
    """`steps` rates from min_rate to max_rate, each the previous times the same factor (to four
    significant digits)."""
    if steps < 2 or not 0 < min_rate < max_rate:
        raise ValueError(f"a rate grid needs 2 or more steps and 0 < min_rate < max_rate, got {steps} "
                         f"steps from {min_rate} to {max_rate}")
    ratio = (max_rate / min_rate) ** (1.0 / (steps - 1))
    return [float(f"{min_rate * ratio**i:.4g}") for i in range(steps - 1)] + [max_rate]


def _bracket(grid: list[float], probes: Iterable[Probe], slo: Slo) -> tuple[int, int]:
    """Grid indices (lo, hi): hi is the lowest probed rate that misses the SLO (len(grid) when
    none does), lo the highest probed rate below it that meets it (-1 when none does). The load
    grows with the rate, so a rate that meets the SLO above one that misses it is noise."""
    verdicts = {grid.index(p.request_rate): p.meets(slo) for p in probes}
    hi = min((i for i, ok in verdicts.items() if not ok), default=len(grid))
    lo = max((i for i, ok in verdicts.items() if ok and i < hi), default=-1)
    return lo, hi


def capacity(grid: list[float], probes: Iterable[Probe], slo: Slo) -> float | None:
    """The capacity at `slo` as far as the probes tell (None: not even the lowest rate meets it)."""
    lo, _ = _bracket(grid, probes, slo)
    return grid[lo] if lo >= 0 else None


def next_rate(grid: list[float], probes: Iterable[Probe], slo: Slo) -> float | None:
    """The rate to probe next for `slo` (the middle of the open bracket), None once it is closed."""
    lo, hi = _bracket(grid, probes, slo)
    return grid[(lo + hi + 1) // 2] if hi - lo > 1 else None


def search(grid: list[float], slos: list[Slo], run_probe: Callable[[float], Probe]) -> list[Probe]:
    """Bisects the grid for every SLO, running each rate at most once; the probes, by rate."""
    probes: dict[float, Probe] = {}
    for slo in slos:
        while (rate := next_rate(grid, probes.values(), slo)) is not None:
            probes[rate] = run_probe(rate)
    return [probes[r] for r in sorted(probes)]


def probe_from_run(rate: float, run: dict, ttft_percentile: float) -> Probe:
    """What the SLOs read of one benchmark_serving run (its compute_metrics result) at `rate`."""
    gaps = [g for itl in run["itls"] for g in itl]
    ttfts = [t for t in run["ttfts"] if t is not None]
    details = {k: run[k] for k in ("completed", "duration", "request_throughput", "output_throughput",
                                   "mean_ttft_ms", "median_ttft_ms", "median_itl_ms", "server") if k in run}
    return Probe(rate, float(np.percentile(gaps, 99)) * 1000 if gaps else 0.0,
                 float(np.percentile(ttfts, ttft_percentile)) * 1000 if ttfts else math.inf,
                 run["failed"], details)


def search_server(name: str, grid: list[float], slos: list[Slo], run_at: Callable[[float], dict]) -> dict:
    """One server's search, printing each probe: its capacity per target and its probes (JSON).
    `run_at(rate)` runs the workload at `rate` and returns benchmark_serving's metrics."""
    bound = max_probes(len(grid), len(slos))
    percentile = slos[0].ttft_percentile

    def run_probe(rate: float) -> Probe:
        probe = probe_from_run(rate, run_at(rate), percentile)
        met = [f"{s.itl_ms:g}" for s in slos if probe.meets(s)]
        print(f"[{name}] rate {rate:.3f} req/s: P99 ITL {probe.p99_itl_ms:.1f} ms, P{percentile:g} TTFT "
              f"{probe.ttft_ms:.0f} ms, {probe.details.get('request_throughput', 0):.2f} req/s served, "
              f"{probe.failed} failed -> meets {', '.join(met) + ' ms' if met else 'no target'} "
              f"(at most {bound} probes)", flush=True)
        return probe

    probes = search(grid, slos, run_probe)
    found = {}
    for slo in slos:
        found[target_key(slo.itl_ms)] = cap = capacity(grid, probes, slo)
        print(f"[{name}] capacity at P99 ITL <= {slo.itl_ms:g} ms and P{percentile:g} TTFT <= "
              f"{slo.ttft_ms:g} ms: " + (f"{cap:.3f} req/s" if cap is not None else f"below {grid[0]:g} req/s"),
              flush=True)
    return {"itl_targets_ms": [s.itl_ms for s in slos], "capacity": found,
            "probes": [dict(request_rate=p.request_rate, p99_itl_ms=p.p99_itl_ms, ttft_ms=p.ttft_ms,
                            failed=p.failed, meets_itl_targets_ms=[s.itl_ms for s in slos if p.meets(s)],
                            **p.details) for p in probes]}


def max_probes(grid_steps: int, num_targets: int) -> int:
    """At most this many probes for one server judged against `num_targets` targets."""
    return min(grid_steps, num_targets * math.ceil(math.log2(grid_steps + 1)))


# --------------------------------------------------------------------------- servers

def drop_flags(flags: list[str], switches: Iterable[str] = (), options: Iterable[str] = ()) -> list[str]:
    """`flags` without the given switches, and without the given options with their values
    (`--name value` or `--name=value`)."""
    switches, options = set(switches), set(options)
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
            continue
        name = flag.split("=", 1)[0]
        if name in options:
            skip = "=" not in flag
        elif name not in switches:
            out.append(flag)
    return out


def budget_servers(engine_flags: list[str], itl_targets_ms: list[float], budgets: list[int]) -> list[ServerSpec]:
    """--compare-budgets: one server per latency target (the largest budget the upper bound),
    judged against its own target, then one per fixed budget, judged against every target."""
    base = drop_flags(engine_flags, BUDGET_SWITCHES, BUDGET_OPTIONS) + ["--enable-chunked-prefill"]
    upper = max(budgets)
    specs = [ServerSpec(f"target-{t:g}ms", base + ["--max-num-batched-tokens", str(upper),
                                                   "--max-step-latency-ms", f"{t:g}"],
                        [t], step_latency_ms=t) for t in itl_targets_ms]
    specs += [ServerSpec(f"budget-{b}", base + ["--max-num-batched-tokens", str(b)], list(itl_targets_ms),
                         budget=b) for b in budgets]
    return specs


# --------------------------------------------------------------------------- verdicts

def target_key(itl_ms: float) -> str:
    """How a target names its capacity in the results ("50" for 50.0 ms)."""
    return f"{itl_ms:g}"


def compare(specs: list[ServerSpec], searches: dict[str, dict]) -> list[dict]:
    """Per target: each server's capacity and whether the latency target's is at least the best
    fixed budget's (None when no server meets the target at any probed rate: nothing to compare).
    `searches[name]` is search_server()'s result for the server `name`."""
    rows = []
    for target in sorted({t for s in specs for t in s.itl_targets_ms}):
        def cap(spec: ServerSpec) -> float | None:
            return searches[spec.name]["capacity"][target_key(target)]

        own = [s for s in specs if s.step_latency_ms == target]
        fixed = {s.budget: cap(s) for s in specs if s.budget is not None}
        latency_cap = cap(own[0]) if own else None
        row = {"itl_slo_ms": target, "latency_target_server": own[0].name if own else None,
               "latency_target_capacity": latency_cap, "fixed_budget_capacity": fixed,
               "best_fixed_budget": None, "best_fixed_capacity": None,
               "latency_target_ge_best_fixed": None}
        met = {b: c for b, c in fixed.items() if c is not None}
        if met:  # the smallest of the budgets that tie
            best = max(met, key=lambda b: (met[b], -b))
            row["best_fixed_budget"], row["best_fixed_capacity"] = best, met[best]
        if own and fixed and (latency_cap is not None or met):
            row["latency_target_ge_best_fixed"] = (latency_cap or 0.0) >= (row["best_fixed_capacity"] or 0.0)
        rows.append(row)
    return rows


def format_table(rows: list[dict], min_rate: float) -> str:
    """The comparison as a text table, capacities in requests per second."""
    budgets = sorted({b for r in rows for b in r["fixed_budget_capacity"]})

    def cap(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else f"<{min_rate:g}"

    header = (["P99 ITL target", "latency target"] + [f"budget {b}" for b in budgets]
              + ["best fixed", "target >= best"])
    lines = [header]
    for r in rows:
        verdict = r["latency_target_ge_best_fixed"]
        lines.append([f"{r['itl_slo_ms']:g} ms", cap(r["latency_target_capacity"])]
                     + [cap(r["fixed_budget_capacity"][b]) for b in budgets]
                     + [f"{r['best_fixed_budget']}" if r["best_fixed_budget"] is not None else "-",
                        {True: "yes", False: "NO", None: "n/a"}[verdict]])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(" | ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)


def estimate_seconds(specs: list[ServerSpec], grid: list[float], num_prompts: int,
                     startup_s: float = 60.0, drain_s: float = 10.0) -> tuple[float, float]:
    """(typical, upper bound) wall time of a search: each server's start-up, then its probes, each
    the arrival window num_prompts / rate at the grid's middle rate plus a drain. Typical: one
    bisection per server plus one probe per further target; upper bound: max_probes()."""
    probe_s = num_prompts / grid[len(grid) // 2] + drain_s
    steps = math.ceil(math.log2(len(grid) + 1))
    typical = sum(startup_s + probe_s * min(len(grid), steps + len(s.itl_targets_ms) - 1) for s in specs)
    upper = sum(startup_s + probe_s * max_probes(len(grid), len(s.itl_targets_ms)) for s in specs)
    return typical, upper
