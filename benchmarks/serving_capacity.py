"""Serving capacity, Sarathi-Serve's metric, for benchmark_serving.py --capacity-search.

The capacity of a server at a time-between-tokens target T is the highest request rate whose
P99 inter-token latency (ITL) is at most T while the TTFT at --ttft-slo-percentile (queueing
included) stays under --ttft-slo-ms: past that rate requests queue faster than they are served,
which shows in the time to first token and not in the gaps between tokens.

Rates come from a geometric grid (--min-rate .. --max-rate, --rate-steps points). A probe is one
run of the workload at one rate against one server; its result is cached per server, and each
target is searched over the cached probes: from --start-rate, two grid steps at a time upward
while the probes meet the target (downward while they miss), until a probe on each side brackets
the capacity, then the bracket is bisected. A probe's verdict for every target is read from the
same run, so a server judged against three targets runs each rate at most once. A capacity at
the grid's top rate is a lower bound (`capacity_is_grid_top`), shown as ">=".

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


def is_grid_top(grid: list[float], probes: Iterable[Probe], slo: Slo) -> bool:
    """Whether the capacity at `slo` is the grid's top rate: a lower bound, not a measurement."""
    return _bracket(grid, probes, slo)[0] == len(grid) - 1


GALLOP = 2  # grid steps between the probes that look for the bracket (2: the rate doubles at ratio sqrt 2)


def next_rate(grid: list[float], probes: Iterable[Probe], slo: Slo, start: int = 0) -> float | None:
    """The rate to probe next for `slo`, None once the capacity is bracketed to one grid step:
    grid[start] first; then GALLOP steps up from the highest rate that meets it while none misses,
    GALLOP steps down from the lowest that misses while none below meets it; then the middle."""
    probes = list(probes)
    if not probes:
        return grid[start]
    lo, hi = _bracket(grid, probes, slo)
    if hi - lo <= 1:
        return None
    if hi == len(grid):
        return grid[min(lo + GALLOP, len(grid) - 1)]
    if lo < 0:
        return grid[max(hi - GALLOP, 0)]
    return grid[(lo + hi + 1) // 2]


def search(grid: list[float], slos: list[Slo], run_probe: Callable[[float], Probe],
           start: int = 0) -> list[Probe]:
    """Searches the grid for every SLO from grid[start], running each rate at most once; the
    probes, by rate."""
    probes: dict[float, Probe] = {}
    for slo in slos:
        while (rate := next_rate(grid, probes.values(), slo, start)) is not None:
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


def search_server(name: str, grid: list[float], slos: list[Slo], run_at: Callable[[float], dict],
                  start: int = 0) -> dict:
    """One server's search from grid[start], printing each probe: its capacity per target and its
    probes (JSON). `run_at(rate)` runs the workload at `rate` and returns benchmark_serving's
    metrics."""
    bound = max_probes(len(grid), len(slos), start)
    percentile = slos[0].ttft_percentile

    def run_probe(rate: float) -> Probe:
        probe = probe_from_run(rate, run_at(rate), percentile)
        met = [f"{s.itl_ms:g}" for s in slos if probe.meets(s)]
        requests = probe.details.get("completed", 0) + probe.failed
        print(f"[{name}] rate {rate:.3f} req/s, {requests} requests: P99 ITL {probe.p99_itl_ms:.1f} ms, "
              f"P{percentile:g} TTFT "
              f"{probe.ttft_ms:.0f} ms, {probe.details.get('request_throughput', 0):.2f} req/s served, "
              f"{probe.failed} failed -> meets {', '.join(met) + ' ms' if met else 'no target'} "
              f"(at most {bound} probes)", flush=True)
        return probe

    probes = search(grid, slos, run_probe, start)
    found, top = {}, {}
    for slo in slos:
        key = target_key(slo.itl_ms)
        found[key] = cap = capacity(grid, probes, slo)
        top[key] = is_grid_top(grid, probes, slo)
        print(f"[{name}] capacity at P99 ITL <= {slo.itl_ms:g} ms and P{percentile:g} TTFT <= "
              f"{slo.ttft_ms:g} ms: " + (f"below {grid[0]:g} req/s" if cap is None else
                                         f"{cap:.3f} req/s" + (" or more (the grid's top)" if top[key] else "")),
              flush=True)
    return {"itl_targets_ms": [s.itl_ms for s in slos], "capacity": found, "capacity_is_grid_top": top,
            "probes": [dict(request_rate=p.request_rate, p99_itl_ms=p.p99_itl_ms, ttft_ms=p.ttft_ms,
                            failed=p.failed, meets_itl_targets_ms=[s.itl_ms for s in slos if p.meets(s)],
                            **p.details) for p in probes]}


def max_probes(grid_steps: int, num_targets: int, start: int = 0) -> int:
    """At most this many probes for one server judged against `num_targets` targets, from
    grid index `start`: the galloping probes sit on every GALLOP-th index from `start` (and
    perhaps an end of the grid), then each target's bracket of GALLOP steps takes one more."""
    on_stride = len(range(start % GALLOP, grid_steps, GALLOP))
    return min(grid_steps, on_stride + 2 + num_targets)


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
    fixed budget's (None when no server meets the target at any probed rate, or when both reach
    the grid's top: nothing to compare). `searches[name]` is search_server()'s result for the
    server `name`."""
    rows = []
    for target in sorted({t for s in specs for t in s.itl_targets_ms}):
        key = target_key(target)

        def cap(spec: ServerSpec) -> float | None:
            return searches[spec.name]["capacity"][key]

        def at_top(spec: ServerSpec) -> bool:
            return searches[spec.name].get("capacity_is_grid_top", {}).get(key, False)

        own = [s for s in specs if s.step_latency_ms == target]
        fixed_specs = [s for s in specs if s.budget is not None]
        fixed = {s.budget: cap(s) for s in fixed_specs}
        latency_cap = cap(own[0]) if own else None
        row = {"itl_slo_ms": target, "latency_target_server": own[0].name if own else None,
               "latency_target_capacity": latency_cap, "fixed_budget_capacity": fixed,
               "at_grid_top": [s.name for s in own[:1] + fixed_specs if at_top(s)],
               "best_fixed_budget": None, "best_fixed_capacity": None,
               "latency_target_ge_best_fixed": None}
        met = {b: c for b, c in fixed.items() if c is not None}
        if met:  # the smallest of the budgets that tie
            best = max(met, key=lambda b: (met[b], -b))
            row["best_fixed_budget"], row["best_fixed_capacity"] = best, met[best]
        best_at_top = any(at_top(s) for s in fixed_specs)
        if own and fixed and (latency_cap is not None or met) and not (at_top(own[0]) and best_at_top):
            row["latency_target_ge_best_fixed"] = (latency_cap or 0.0) >= (row["best_fixed_capacity"] or 0.0)
        rows.append(row)
    return rows


def format_table(rows: list[dict], min_rate: float) -> str:
    """The comparison as a text table, capacities in requests per second (">=": the grid's top)."""
    budgets = sorted({b for r in rows for b in r["fixed_budget_capacity"]})

    def cap(value: float | None, top: bool) -> str:
        return f"{'>=' if top else ''}{value:.2f}" if value is not None else f"<{min_rate:g}"

    header = (["P99 ITL target", "latency target"] + [f"budget {b}" for b in budgets]
              + ["best fixed", "target >= best"])
    lines = [header]
    for r in rows:
        verdict = r["latency_target_ge_best_fixed"]
        top = set(r.get("at_grid_top", []))
        lines.append([f"{r['itl_slo_ms']:g} ms", cap(r["latency_target_capacity"], r["latency_target_server"] in top)]
                     + [cap(r["fixed_budget_capacity"][b], f"budget-{b}" in top) for b in budgets]
                     + [f"{r['best_fixed_budget']}" if r["best_fixed_budget"] is not None else "-",
                        {True: "yes", False: "NO", None: "n/a"}[verdict]])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(" | ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)


def estimate_seconds(specs: list[ServerSpec], grid: list[float], probe_seconds: Callable[[float], float],
                     start: int = 0, fail_rate: float = 4.0, startup_s: float = 60.0) -> tuple[float, float]:
    """(typical, upper bound) wall time of a search: each server's start-up, then its probes,
    `probe_seconds(rate)` each. Typical: every server meets its targets up to the grid's start
    and misses them all from `fail_rate` on, so it gallops from the start to the first rate at or
    past `fail_rate`, and each target bisects one bracket. Upper bound: max_probes() probes of the
    slowest kind."""
    typical = upper = 0.0
    for spec in specs:
        i, galloped = start, []
        while True:
            galloped.append(grid[i])
            if grid[i] >= fail_rate or i == len(grid) - 1:
                break
            i = min(i + GALLOP, len(grid) - 1)
        between = [grid[j] for j in range(start + 1, i) if grid[j] not in galloped]
        bisected = between[-len(spec.itl_targets_ms):] if between else []
        typical += startup_s + sum(probe_seconds(r) for r in galloped + bisected)
        upper += startup_s + max_probes(len(grid), len(spec.itl_targets_ms), start) * max(map(probe_seconds, grid))
    return typical, upper
