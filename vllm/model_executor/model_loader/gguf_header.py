"""The tensor table of a GGUF file, read from its header without parsing every field.

A GGUF file is its header, then the tensors' bytes:

    magic "GGUF" | version u32 | tensor count u64 | field count u64
    fields:  key (u64 length + UTF-8) | value type u32 | value
    tensors: name | dim count u32 | dims u64... (fastest first) | ggml type u32 | offset u64
    padding to the alignment (general.alignment, else 32) | the tensors' bytes, from offsets

The gguf package's reader makes a numpy view of every field's every part: for a vocabulary of
tens of thousands of tokens and merges, seconds. Loading needs only the tensor table, the
architecture and the alignment, so this reader steps over the other fields' values by their
lengths and decodes nothing else.
"""

import dataclasses
import mmap
import struct
from math import prod

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # v1 counted in 32 bits; llama.cpp has written v3 since 2023
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# Value type -> width in bytes of the fixed-size types: u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64.
_WIDTHS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_UINT_FORMATS = {0: "<B", 2: "<H", 4: "<I", 10: "<Q"}  # the types general.alignment may have


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor's bytes lie in the file, and what they hold."""
    name: str
    type_name: str              # a GGMLQuantizationType name: "Q4_1", "F32", ...
    shape: tuple[int, ...]      # numpy order (GGUF lists the dims fastest-first)
    offset: int                 # of the first byte in the file
    num_bytes: int


@dataclasses.dataclass(frozen=True)
class GGUFIndex:
    architecture: str
    tensors: tuple[GGUFTensorInfo, ...]


class _Header:
    """A cursor over the header's bytes; a read past their end is a truncated file."""

    def __init__(self, data) -> None:
        self.data, self.pos = data, 0

    def unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise ValueError("the header ends early (a truncated file?)")
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        return self.raw(length).decode("utf-8")

    def raw(self, length: int) -> bytes:
        if self.pos + length > len(self.data):
            raise ValueError("the header ends early (a truncated file?)")
        self.pos += length
        return bytes(self.data[self.pos - length:self.pos])

    def skip_value(self, value_type: int) -> None:
        if value_type in _WIDTHS:
            self.pos += _WIDTHS[value_type]
        elif value_type == _STRING:
            (length,) = self.unpack("<Q")
            self.pos += length
        elif value_type == _ARRAY:
            element_type, count = self.unpack("<IQ")
            if element_type in _WIDTHS:
                self.pos += count * _WIDTHS[element_type]
            else:
                for _ in range(count):
                    self.skip_value(element_type)
        else:
            raise ValueError(f"unknown metadata value type {value_type}")


def read_gguf_index(path: str) -> GGUFIndex:
    """The architecture and tensor table of the GGUF file at `path`. Raises ValueError naming what
    is wrong with a file that is not GGUF v2/v3, is cut short, or holds a tensor of a type the
    gguf package does not know or whose rows are not whole blocks of its type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        header = _Header(data)
        if header.raw(4) != _MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic)")
        version, tensor_count, field_count = header.unpack("<IQQ")
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (only {_VERSIONS})")
        architecture, alignment = "", _DEFAULT_ALIGNMENT
        for _ in range(field_count):
            key = header.string()
            (value_type,) = header.unpack("<I")
            if key == "general.architecture" and value_type == _STRING:
                architecture = header.string()
            elif key == "general.alignment" and value_type in _UINT_FORMATS:
                (alignment,) = header.unpack(_UINT_FORMATS[value_type])
            else:
                header.skip_value(value_type)
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment} is not a power of two")
        table = []
        for _ in range(tensor_count):
            name = header.string()
            (dim_count,) = header.unpack("<I")
            dims = header.unpack(f"<{dim_count}Q")
            type_id, offset = header.unpack("<IQ")
            table.append((name, dims, type_id, offset))
        data_start = -(-header.pos // alignment) * alignment
        file_size = len(data)

    tensors = []
    for name, dims, type_id, offset in table:
        try:
            quant_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"tensor {name} has an unknown ggml type {type_id}") from None
        block_elements, block_bytes = GGML_QUANT_SIZES[quant_type]
        if dims and dims[0] % block_elements:
            raise ValueError(f"tensor {name}: rows of {dims[0]} are not whole {quant_type.name} blocks "
                             f"of {block_elements}")
        num_bytes = prod(dims) // block_elements * block_bytes
        if data_start + offset + num_bytes > file_size:
            raise ValueError(f"tensor {name} ends past the end of the file (a truncated file?)")
        tensors.append(GGUFTensorInfo(name, quant_type.name, tuple(reversed(dims)), data_start + offset, num_bytes))
    return GGUFIndex(architecture, tuple(tensors))
