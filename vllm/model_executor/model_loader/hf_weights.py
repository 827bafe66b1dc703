"""Reads the tensors of a Hugging Face checkpoint directory (safetensors, else PyTorch .bin)."""

import glob
import os
from collections.abc import Iterator

import torch


def iter_hf_weights(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if files:
        from safetensors import safe_open

        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors file is not iterable)
                    yield name, f.get_tensor(name)
        return
    files = sorted(glob.glob(os.path.join(directory, "pytorch_model*.bin")))
    if not files:
        raise ValueError(f"model directory {directory!r} has no *.safetensors or pytorch_model*.bin weights")
    for path in files:
        yield from torch.load(path, map_location="cpu", weights_only=True).items()
