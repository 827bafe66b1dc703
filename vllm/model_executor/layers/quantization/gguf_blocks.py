"""GGUF's quantized block types that the engine keeps quantized in memory.

A GGUF matrix of N rows of K weights is N rows of K / `block_size(type)` blocks: blocks of 32
weights, a scale (and, for Q4_1, a minimum) plus 32 codes, or super-blocks of 256: Q4_K's, two
scales and the 6-bit scales and minimums of their eight 32-weight sub-blocks plus 256 codes,
and Q6_K's, one scale, the 8-bit scales of their sixteen runs of 16 and 256 6-bit codes (see
vllm/csrc/cpu/cpu_gguf_gemv_blocks.h for the layouts). The engine holds such a matrix as a
uint8 tensor of shape (N, K / block size * block bytes): rows stay whole, so slicing output rows
(q/k/v, the vocabulary) is slicing tensor rows.

Once a model is loaded, the CPU kernels may regroup a weight's rows into 16-row panels for
their int8 GEMM (cpu_gguf_gemv.to_panels): the same bytes and shape, its type then carrying
the PANELS flag, a layout rather than a type (`base_type` removes it). Its rows can no longer
be sliced.
"""

from dataclasses import dataclass

import torch

# GGMLQuantizationType value -> (name, weights per block, bytes per block).
_TYPES = {8: ("Q8_0", 32, 34), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 12: ("Q4_K", 256, 144),
          14: ("Q6_K", 256, 210)}
PANELS = 0x100  # GGUF_PANELS of cpu_gguf_gemv_blocks.h


def base_type(quant_type: int) -> int:
    """The GGMLQuantizationType of a type that may carry the PANELS flag."""
    return quant_type & ~PANELS


def supported_type_names() -> list[str]:
    return [name for name, _, _ in _TYPES.values()]


def type_of(name: str) -> int:
    """The GGMLQuantizationType of a supported type's name ("Q4_1" -> 3)."""
    return next(t for t, (type_name_, _, _) in _TYPES.items() if type_name_ == name)


def is_supported(quant_type: int) -> bool:
    return quant_type in _TYPES


def type_name(quant_type: int) -> str:
    return _TYPES[base_type(quant_type)][0]


def block_size(quant_type: int) -> int:
    """Weights per block of `quant_type`: a row's length must be a multiple of it."""
    return _TYPES[quant_type][1]


def row_bytes(quant_type: int, k: int) -> int:
    """Bytes of one row of `k` weights of `quant_type` (k a multiple of its block size)."""
    _, size, nbytes = _TYPES[quant_type]
    assert k % size == 0, f"a row of {k} weights is not whole {type_name(quant_type)} blocks"
    return k // size * nbytes


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
