"""Buckets: the few sizes a per-step dimension is padded to, so that captured graphs are reused.

The token buckets bound the step's flattened token count; every platform that captures graphs
uses them. Where a device compiles per shape (Gaudi), the attention backend pads its own
per-step tensors to buckets of their own, built with the helpers here
(vllm/attention/backends/hpu_metadata.py). Environment overrides of the token buckets, in the
style of the Habana fork:

    VLLM_EXPONENTIAL_BUCKETING  "true" (default): min, 2*min, 4*min, ... up to max
                                "false": linear: min, then multiples of step, up to max
    VLLM_TOKEN_BUCKET_MIN       smallest bucket (default: the platform's `min_token_bucket`, 128
                                on HPU, 2 on CPU)
    VLLM_TOKEN_BUCKET_STEP      linear step (default 128)
    VLLM_TOKEN_BUCKET_MAX       largest bucket (default and upper bound: max_num_batched_tokens)
"""

import bisect
import os
from dataclasses import dataclass

DEFAULT_MIN = 16
DEFAULT_STEP = 128


@dataclass(frozen=True)
class BucketConfig:
    min: int
    step: int
    max: int
    exponential: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.min <= self.max:
            raise ValueError(f"token buckets need 0 < min ({self.min}) <= max ({self.max})")
        if self.step <= 0:
            raise ValueError(f"token bucket step must be positive, got {self.step}")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def bucket_config_from_env(max_num_batched_tokens: int, default_min: int = DEFAULT_MIN) -> BucketConfig:
    flag = os.environ.get("VLLM_EXPONENTIAL_BUCKETING", "true").lower()
    if flag not in ("true", "false", "1", "0"):
        raise ValueError(f"VLLM_EXPONENTIAL_BUCKETING={flag!r} must be true or false")
    max_tokens = _env_int("VLLM_TOKEN_BUCKET_MAX", max_num_batched_tokens)
    if max_tokens < max_num_batched_tokens:
        raise ValueError(f"VLLM_TOKEN_BUCKET_MAX={max_tokens} is below max_num_batched_tokens="
                         f"{max_num_batched_tokens}: some steps would fit no bucket")
    return BucketConfig(min=min(_env_int("VLLM_TOKEN_BUCKET_MIN", default_min), max_tokens),
                        step=_env_int("VLLM_TOKEN_BUCKET_STEP", DEFAULT_STEP),
                        max=max_tokens, exponential=flag in ("true", "1"))


def generate_buckets(cfg: BucketConfig) -> list[int]:
    """All padded token counts, ascending; the last is always `cfg.max`."""
    buckets = []
    size = cfg.min
    while size < cfg.max:
        buckets.append(size)
        if cfg.exponential:
            size *= 2
        else:
            size = (size // cfg.step + 1) * cfg.step
    buckets.append(cfg.max)
    return buckets


def find_bucket(buckets: list[int], num_tokens: int) -> int | None:
    """The smallest bucket holding `num_tokens`, or None if it exceeds the largest."""
    i = bisect.bisect_left(buckets, num_tokens)
    return buckets[i] if i < len(buckets) else None


def exponential_buckets(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, 4 lo, ... and finally hi itself; [] when hi < lo."""
    if hi < lo:
        return []
    return generate_buckets(BucketConfig(min=lo, step=DEFAULT_STEP, max=hi))


def pad_to_bucket(buckets: list[int], n: int) -> int:
    """The smallest bucket holding `n`; a ValueError naming the largest if none does."""
    bucket = find_bucket(buckets, n)
    if bucket is None:
        raise ValueError(f"{n} exceeds the largest bucket ({buckets[-1] if buckets else 0})")
    return bucket


def reachable(buckets: list[int], limit: int) -> list[int]:
    """The buckets a value of at most `limit` can be padded to."""
    out = []
    for b in buckets:
        out.append(b)
        if b >= limit:
            break
    return out
