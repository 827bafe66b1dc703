"""Per-request sampling parameters, with vLLM's names and validation."""

from dataclasses import dataclass, field

# Below this temperature sampling is treated as greedy, as in vLLM.
_SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    `temperature=0` is greedy. `top_k=0` or `-1` and `top_p=1` disable those filters. A `seed`
    gives the request its own random stream, so its tokens do not depend on which other requests
    share a step, nor on how its prompt was chunked.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.n != 1:
            raise ValueError(f"n must be 1 (parallel sampling is not supported yet), got {self.n}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disable) or a positive integer, got {self.top_k}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS
