"""Environment variables read in more than one place."""

import os
from pathlib import Path


def cache_root() -> Path:
    """VLLM_CACHE_ROOT (default ~/.cache/vllm): built kernels and converted model metadata, each
    keyed by what it was made from. Read when called, so tests may point it elsewhere."""
    return Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm"))
