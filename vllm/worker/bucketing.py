"""Token-count buckets: the few static shapes every step is padded to, so graphs are reused.

Only one dimension is bucketed: the step's flattened token count. Attention, whose inputs vary
with the number of sequences and their lengths, is an op the captured graphs do not trace, so
the Habana fork's (batch size x sequence length) and (batch size x blocks) grids collapse into
one short list. Environment overrides, in the style of the Habana fork:

    VLLM_EXPONENTIAL_BUCKETING  "true" (default): min, 2*min, 4*min, ... up to max
                                "false": linear: min, then multiples of step, up to max
    VLLM_TOKEN_BUCKET_MIN       smallest bucket (default: the platform's `min_token_bucket`, 16
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
