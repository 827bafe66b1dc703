"""What the engine needs to know about the device it runs on."""

from collections.abc import Callable

import torch


class Platform:
    """Base class; one subclass per device type. Holds no per-step state."""

    device_type: str = "cpu"
    # Compute dtype chosen by dtype="auto".
    default_dtype: torch.dtype = torch.float32
    # Whether graph capture is off unless the user asks for it (enforce_eager=False).
    default_enforce_eager: bool = False
    # True: one compiled graph whose token dimension is symbolic serves every bucket.
    # False: one static graph per bucket, as device graph runtimes need.
    symbolic_token_count: bool = False
    # Smallest token bucket unless VLLM_TOKEN_BUCKET_MIN says otherwise (vllm/worker/bucketing.py).
    min_token_bucket: int = 16

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def synchronize(self) -> None:
        """Waits for queued device work (for timing)."""

    def mark_step(self) -> None:
        """Ends a lazily traced region (HPU lazy mode); a no-op on eager devices."""

    def compile_fn(self) -> Callable[[Callable], Callable]:
        """Returns the function that captures the model (see `symbolic_token_count`)."""
        raise NotImplementedError
