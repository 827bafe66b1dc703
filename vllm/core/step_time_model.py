"""Predicted time of one engine step, and the step size that keeps it under a latency target.

A step's time is modelled as linear in four features of the step:

    t = c0 + c1 * tokens + c2 * prefill pairs + c3 * decode keys + overhead

`tokens` is the step's batched token count (the linear layers, padding included). Attention
is two features, as it runs two ways: a prefill chunk of n tokens after a context of c reads
c + 1 ... c + n keys, n * c + n * (n + 1) / 2 query-key pairs, as a product of matrices; a
decode reads its c + 1 keys for one query, a product of a matrix and a vector, which costs
several times more a pair. One coefficient for both would take the decodes' price, as nearly
every step is a decode, and charge it to the chunks of long prompts: a chunk after a long
context would be predicted several times slower than it runs.

The coefficients are fitted by least squares on the relative error (a step's error over its
time, so that the small steps a tight target allows are fitted as well as the largest bucket),
none negative (so the predicted time grows with the step), on the timed warm-up runs of every
token bucket (padding only: `tokens` alone) and on the latest measured steps, which bring in
attention and `overhead`: what an engine step costs beyond the forward pass the warm-up times
(scheduling, inputs, sampling, outputs), a coefficient of its own so that it does not bend the
slope the warm-up runs give. The latest steps are kept in two windows, those with a prefill
chunk and those without: the decode-only steps, most of them, do not push the few with chunks,
which alone fit the prefill pairs, out of the fit.

A target bounds the slow steps, not the average one: the budget is sized for the prediction
plus `tail_seconds`, the TAIL_QUANTILE over the recent steps' tokens of how much longer than the
current fit predicts they ran (contention, the server's own threads, what the features leave
out). It is a time, not a ratio: such delays come on top of a step whatever its size, so a
small step's jitter must not scale a large one's budget. Each step counts once per decode it
carried, as its gaps count in the target's percentile: steps without decodes, whose time no
gap waits on, do not count, nor do steps predicted over `tail_limit_seconds` (the target):
their decodes miss it whatever the error, and the error of a long step, which grows with it,
would shrink the budget of every step sized to meet the target (and so make more steps miss
it, and the tail grow). It is read against the current fit, not the fits of the past: an
early misfit, corrected since, does not stay in it for a window's length.
Imports no torch.
"""

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np


def attended_pairs(chunks: Iterable[tuple[int, int]]) -> int:
    """Query-key pairs of a step whose chunks are (num_tokens, context_len) pairs."""
    return sum(n * c + n * (n + 1) // 2 for n, c in chunks)


@dataclass(frozen=True, slots=True)
class StepShape:
    """What the step-time model reads of a step."""

    num_tokens: int          # batched tokens, as run (a padded bucket, or the real count)
    prefill_pairs: int = 0   # query-key pairs of its prefill chunks (`attended_pairs`)
    decode_keys: int = 0     # keys its decodes read, context + 1 each
    num_decodes: int = 0     # the gaps between tokens that wait on the step (its weight in the tail)

    def features(self) -> tuple[float, float, float, float]:
        return (1.0, float(self.num_tokens), float(self.prefill_pairs), float(self.decode_keys))


NUM_FEATURES = 4
# The target bounds a P99 over tokens, and a step's gaps are all its decodes'. The 1% of gaps
# that the percentile leaves over the target is shared in halves: one for the steps that run
# over it on purpose (MISS_ALLOWANCE), one for those that run late unforeseen, which the tail
# leaves out by its quantile.
TARGET_QUANTILE = 0.99
# A step over the target to drain the prompt queue misses the gaps of all its decodes: it may
# run while the recent gaps over the target, its own included, stay within this share of the
# gaps. Counted over the last MISS_WINDOW_STEPS measured steps with decodes.
MISS_ALLOWANCE = (1.0 - TARGET_QUANTILE) / 2
MISS_WINDOW_STEPS = 2048
TAIL_QUANTILE = 1.0 - MISS_ALLOWANCE
MIN_TAIL_SAMPLES = 16  # measured steps with decodes before the tail departs from 0


class StepTimeModel:
    """Least-squares step times from warm-up runs (kept) and the last `window` measured steps
    with a prefill chunk and the last `window` without.

    Invariants: the coefficients and the overhead are never negative, so `predict` grows with
    every feature; `tail_seconds` is never negative.
    """

    def __init__(self, window: int = 256, tail_limit_seconds: float = float("inf")) -> None:
        self.tail_limit_seconds = tail_limit_seconds
        self._warmup: list[tuple[tuple[float, ...], float]] = []
        # (features, seconds, decodes) of the measured steps, with and without prefill pairs
        self._recent_prefills: deque[tuple[tuple[float, ...], float, int]] = deque(maxlen=window)
        self._recent_decodes: deque[tuple[tuple[float, ...], float, int]] = deque(maxlen=window)
        self._coefficients: tuple[float, ...] = (0.0,) * NUM_FEATURES
        self._overhead = 0.0
        self._tail_seconds = 0.0
        # Refitted when read after a new sample: most steps (decodes, nobody waiting) are
        # observed but size nothing.
        self._stale = False
        # (decodes, decodes of a step over tail_limit_seconds) of the measured steps with
        # decodes, and the sums of both over them.
        self._gaps: deque[tuple[int, int]] = deque()
        self._num_gaps = 0
        self._num_missed = 0

    @property
    def num_observations(self) -> int:
        return len(self._warmup) + len(self._recent_prefills) + len(self._recent_decodes)

    @property
    def is_fitted(self) -> bool:
        return self.num_observations > 0

    @property
    def coefficients(self) -> tuple[float, ...]:
        """Seconds of the forward pass per unit of each feature."""
        self._refit()
        return self._coefficients

    @property
    def overhead(self) -> float:
        """Seconds a measured step takes beyond its forward pass."""
        self._refit()
        return self._overhead

    def fit_warmup(self, samples: Sequence[tuple[StepShape, float]]) -> None:
        """Replaces the warm-up samples, (shape, seconds) of timed runs."""
        self._warmup = [(shape.features(), seconds) for shape, seconds in samples]
        self._stale = True

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A measured step, in the fit from the next read on."""
        recent = self._recent_prefills if shape.prefill_pairs else self._recent_decodes
        recent.append((shape.features(), seconds, shape.num_decodes))
        self._stale = True
        if shape.num_decodes:
            missed = shape.num_decodes if seconds > self.tail_limit_seconds else 0
            self._count_gaps(shape.num_decodes, missed)

    def may_miss(self, num_decodes: int) -> bool:
        """Whether a step of `num_decodes` decodes may run over `tail_limit_seconds` (the
        target): its gaps, with the recent gaps over it, stay within MISS_ALLOWANCE of the
        recent gaps and its own."""
        return self._num_missed + num_decodes <= MISS_ALLOWANCE * (self._num_gaps + num_decodes)

    def _count_gaps(self, num_decodes: int, missed: int) -> None:
        if len(self._gaps) == MISS_WINDOW_STEPS:
            old_decodes, old_missed = self._gaps.popleft()
            self._num_gaps -= old_decodes
            self._num_missed -= old_missed
        self._gaps.append((num_decodes, missed))
        self._num_gaps += num_decodes
        self._num_missed += missed

    def predict(self, shape: StepShape) -> float:
        """Seconds of an engine step; 0 before any sample."""
        return float(np.dot(self.coefficients, shape.features())) + self.overhead

    @property
    def tail_seconds(self) -> float:
        """The TAIL_QUANTILE over the decodes of the recent steps predicted within
        `tail_limit_seconds` of their measured time beyond the current fit's prediction, at
        least 0; 0 until MIN_TAIL_SAMPLES such steps were measured."""
        self._refit()
        return self._tail_seconds

    def _refit(self) -> None:
        if not self._stale:
            return
        self._stale = False
        recent = [*self._recent_prefills, *self._recent_decodes]
        rows = self._warmup + [(features, seconds) for features, seconds, _ in recent]
        if not rows:
            return
        measured = np.zeros((len(rows), 1))                    # (N, 1) 1 for a measured step
        measured[len(self._warmup):] = 1.0
        x = np.hstack([np.array([f for f, _ in rows], dtype=np.float64), measured])  # (N, F + 1)
        y = np.array([t for _, t in rows], dtype=np.float64)   # (N,)
        # Each row over its time: least squares on the relative error. (A zero time, which no
        # real step takes, keeps its absolute error.)
        weight = 1.0 / np.where(y > 0, y, 1.0)                 # (N,)
        coefficients = _non_negative_lstsq(x * weight[:, None], y * weight)
        self._coefficients = tuple(float(c) for c in coefficients[:NUM_FEATURES])
        self._overhead = float(coefficients[NUM_FEATURES])
        self._tail_seconds = 0.0
        if not recent:
            return
        predicted = x[len(self._warmup):] @ coefficients                    # (num_recent,)
        decodes = np.array([d for _, _, d in recent], dtype=np.float64)     # (num_recent,)
        decodes[predicted > self.tail_limit_seconds] = 0.0  # missed the target whatever the error
        if np.count_nonzero(decodes) >= MIN_TAIL_SAMPLES:
            excess = y[len(self._warmup):] - predicted                      # (num_recent,)
            self._tail_seconds = max(0.0, _weighted_quantile(excess, decodes, TAIL_QUANTILE))


def _weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The smallest of `values` (n,) with at least the fraction q of the total `weights` (n,),
    none negative, on or below it."""
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, q * cumulative[-1])])


def _non_negative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin |x c - y| over c >= 0, for a few columns: least squares on every subset of the
    columns (5 columns: 31 subsets), keeping the best solution with none negative. The subsets
    are solved at once, on the normal equations: a few columns square, whatever the rows."""
    num_cols = x.shape[1]
    # Columns scaled to unit norm, so that pairs (up to ~1e8) and the constant compare.
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    gram, moment = xs.T @ xs, xs.T @ y                     # (F, F), (F,)
    masks = (np.arange(1, 1 << num_cols)[:, None] >> np.arange(num_cols)) & 1 == 1  # (S, F) subsets
    both = masks[:, :, None] & masks[:, None, :]                                     # (S, F, F)
    # Each subset's system, with the identity on the columns it leaves out (whose
    # coefficients come out 0); a zero column (none of a feature yet) is kept solvable.
    identity = np.eye(num_cols)
    systems = np.where(both, gram + 1e-12 * identity, identity)                       # (S, F, F)
    coef = np.linalg.solve(systems, np.where(masks, moment, 0.0)[:, :, None])[:, :, 0]  # (S, F)
    # |xs c - y|^2 = y.y - 2 c.moment + c.gram.c
    error = y @ y - 2 * coef @ moment + np.einsum("sf,fg,sg->s", coef, gram, coef)   # (S,)
    error[np.any(coef < 0, axis=1)] = np.inf
    if not np.isfinite(error).any() or error.min() >= y @ y:
        return np.zeros(num_cols)
    return coef[np.argmin(error)] / scale


# Prefill tokens a step holds beside its decodes even when the model predicts it over target:
# the waiting prompts always progress.
MIN_PREFILL_CHUNK = 16


def padded_size(sizes: Sequence[int], num_tokens: int) -> int:
    """The size a step of `num_tokens` runs at: the smallest of `sizes` (ascending) that holds
    it, or `num_tokens` itself when there is none (no buckets, or an eager step)."""
    for size in sizes:
        if size >= num_tokens:
            return size
    return num_tokens


@dataclass(frozen=True, slots=True)
class StepBudget:
    num_tokens: int          # the step's token budget, decodes included
    predicted_seconds: float


def latency_budget(model: StepTimeModel, target_seconds: float, *, decode_keys: int,
                   num_decodes: int, prefill_chunks: Callable[[int], list[tuple[int, int]]],
                   sizes: Sequence[int], max_num_batched_tokens: int, min_prefill_tokens: int = 0,
                   may_miss: bool = True) -> StepBudget:
    """The token budget of a step holding `num_decodes` decodes (reading `decode_keys` keys)
    and prefill chunks in the rest, priced as `prefill_chunks(n)` gives them for n prefill
    tokens: (num_tokens, context_len) pairs. The target is on the gaps between a request's
    tokens, so only the decodes wait on the step:

    - without decodes nobody waits: the whole `max_num_batched_tokens`;
    - else the largest step whose predicted time, plus the model's tail, is within
      `target_seconds`, with at least `min_prefill_tokens` (the waiting prompts' drain rate)
      and MIN_PREFILL_CHUNK prefill tokens;
    - and when even that smallest step is over the target, its decodes miss it whatever the
      chunk: if `may_miss` (the target's percentile has room for their gaps), the whole
      `max_num_batched_tokens`, so that the prompts finish in as few such steps as possible
      (the target being a percentile over tokens, each miss counts once per decode, however
      long); else the target wins over the drain rate: the largest step within it with at
      least MIN_PREFILL_CHUNK prefill tokens (or the smallest such step), and the prompts
      queue as they would behind a fixed budget of that size.

    With `sizes` (the warmed token buckets, ascending) the step is one of them, priced at the
    bucket the tokens it buys run in: the chunk fills it unless the prompts run out. Without,
    any count. Never above `max_num_batched_tokens`.
    """
    def predict(total: int) -> float:
        chunks = prefill_chunks(total - num_decodes)  # may buy less than asked: the prompts' need
        tokens = num_decodes + sum(n for n, _ in chunks)
        return model.predict(StepShape(padded_size(sizes, tokens), attended_pairs(chunks), decode_keys, num_decodes))

    def chosen(total: int) -> StepBudget:
        return StepBudget(total, predict(total))

    if num_decodes == 0:
        return chosen(max_num_batched_tokens)
    target_seconds -= model.tail_seconds  # the slow steps, not the average one, within target

    least = min(num_decodes + MIN_PREFILL_CHUNK, max_num_batched_tokens)
    floor = min(num_decodes + max(MIN_PREFILL_CHUNK, min_prefill_tokens), max_num_batched_tokens)
    if sizes:
        candidates = [s for s in sizes if s <= max_num_batched_tokens]
        if not candidates or candidates[-1] < max_num_batched_tokens:
            candidates.append(max_num_batched_tokens)
        fitting = [s for s in candidates if s >= floor and predict(s) <= target_seconds]
        if fitting:
            return chosen(fitting[-1])
        if may_miss:
            return chosen(max_num_batched_tokens)
        within = [s for s in candidates if least <= s < floor and predict(s) <= target_seconds]
        return chosen(within[-1] if within else next(s for s in candidates if s >= least))
    # Any count: the prediction grows with it, so bisect for the largest within target.
    lo, hi = floor, max_num_batched_tokens
    if predict(lo) > target_seconds:
        if may_miss:
            return chosen(max_num_batched_tokens)
        lo, hi = least, floor
        if predict(lo) > target_seconds:
            return chosen(lo)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if predict(mid) <= target_seconds:
            lo = mid
        else:
            hi = mid - 1
    return chosen(lo)
