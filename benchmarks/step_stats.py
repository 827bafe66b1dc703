"""Statistics of a run: percentiles and mean/median/std summaries in vLLM's conventions (numpy's
linear interpolation), and `StepRecorder`, which times every `LLMEngine.step()` and records its
token composition from the engine's public `stats` counters around the call."""

from __future__ import annotations

import time
from dataclasses import dataclass

# The engine's public counters (LLMEngine.stats); read with getattr so a renamed one reads 0.
STAT_FIELDS = ("num_steps", "num_prefill_tokens", "num_decode_tokens", "num_mixed_steps",
               "num_preemptions")


def mean_seconds(fn, repeats: int) -> float:
    """Mean seconds of `repeats` calls of `fn`, after one warm-up call."""
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


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
