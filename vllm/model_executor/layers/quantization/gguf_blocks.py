"""GGUF's quantized block types that the engine keeps quantized in memory.

A GGUF matrix of N rows of K weights is N rows of K / 32 blocks, each block a scale (and, for
Q4_1, a minimum) plus 32 codes (see cpu_gguf_gemv.c for the layouts). The engine holds such a
matrix as a uint8 tensor of shape (N, K / 32 * block bytes): rows stay whole, so slicing output
rows (q/k/v, the vocabulary) is slicing tensor rows.
"""

from dataclasses import dataclass

import torch

# GGMLQuantizationType value -> (name, bytes per block of BLOCK_SIZE weights).
_TYPES = {8: ("Q8_0", 34), 2: ("Q4_0", 18), 3: ("Q4_1", 20)}
BLOCK_SIZE = 32


def supported_type_names() -> list[str]:
    return [name for name, _ in _TYPES.values()]


def is_supported(quant_type: int) -> bool:
    return quant_type in _TYPES


def type_name(quant_type: int) -> str:
    return _TYPES[quant_type][0]


def row_bytes(quant_type: int, k: int) -> int:
    """Bytes of one row of `k` weights of `quant_type` (k a multiple of BLOCK_SIZE)."""
    assert k % BLOCK_SIZE == 0, f"a row of {k} weights is not whole blocks"
    return k // BLOCK_SIZE * _TYPES[quant_type][1]


@dataclass(frozen=True)
class GGUFBlocks:
    """A checkpoint matrix left in its GGUF blocks: `data` (rows, row bytes) uint8, standing for
    a (rows, `in_features`) matrix of `quant_type` (a GGMLQuantizationType value)."""

    data: torch.Tensor
    quant_type: int
    in_features: int

    def __post_init__(self) -> None:
        assert self.data.dtype == torch.uint8 and self.data.dim() == 2
        assert self.data.shape[1] == row_bytes(self.quant_type, self.in_features)

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of the matrix the blocks stand for."""
        return self.data.shape[0], self.in_features
