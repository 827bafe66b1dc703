"""The GGUF tensor table read from the header (gguf_header.py) against the gguf package's reader,
and the errors for files that are not whole GGUF files."""

import struct

import numpy as np
import pytest

from tests.k_quant_blocks import quantize_q4_k
from tests.utils import smollm2_path
from vllm.model_executor.model_loader import gguf_metadata
from vllm.model_executor.model_loader.gguf_header import read_gguf_index

gguf = pytest.importorskip("gguf")


def _reference(path: str) -> tuple[str, list[tuple]]:
    reader = gguf.GGUFReader(path)
    return reader.fields["general.architecture"].contents(), [
        (t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)), int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors]


def _index(path: str) -> tuple[str, list[tuple]]:
    index = read_gguf_index(path)
    return index.architecture, [(t.name, t.type_name, t.shape, t.offset, t.num_bytes) for t in index.tensors]


def test_smollm2s_table_is_the_gguf_packages():
    architecture, tensors = _index(smollm2_path())
    assert (architecture, tensors) == _reference(smollm2_path())
    assert len(tensors) == 272 and {t[1] for t in tensors} == {"Q4_1", "Q8_0", "F32"}


def _write(path: str, alignment: int | None) -> None:
    """Fields of every value type (arrays of strings and of arrays among them), then tensors of
    float, block and super-block types."""
    writer = gguf.GGUFWriter(path, "qwen2")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("test.u8", 7)
    writer.add_int16("test.i16", -3)
    writer.add_float64("test.f64", 0.5)
    writer.add_bool("test.bool", True)
    writer.add_string("test.string", "é" * 5)
    writer.add_array("test.strings", ["a", "bc", "", "déf"])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_uint64("test.u64", 2**40)
    rng = np.random.default_rng(0)
    writer.add_tensor("norm", rng.standard_normal(5).astype(np.float32))
    writer.add_tensor("half", rng.standard_normal((3, 4)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((3, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    q4_k = quantize_q4_k(rng.standard_normal((2, 512)).astype(np.float32))
    writer.add_tensor("q4_k", q4_k, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 4096])
def test_a_written_files_table_is_the_gguf_packages(tmp_path, alignment):
    path = str(tmp_path / "t.gguf")
    _write(path, alignment)
    architecture, tensors = _index(path)
    assert (architecture, tensors) == _reference(path)
    assert [t[0] for t in tensors] == ["norm", "half", "q8", "q4_k"]
    assert all(t[3] % (alignment or 32) == 0 for t in tensors)


def _one_tensor(dims: tuple[int, ...], type_id: int, data_bytes: int, version: int = 3) -> bytes:
    """A GGUF file by hand: no fields, one tensor of `dims` (fastest first) at offset 0."""
    name = b"w"
    header = struct.pack("<4sIQQ", b"GGUF", version, 1, 0)
    header += struct.pack("<Q", len(name)) + name + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, 0)
    return header + b"\0" * (-len(header) % 32) + b"\1" * data_bytes


@pytest.mark.parametrize("content,message", [
    (b"PK\3\4 not a model", "not a GGUF file"),
    (_one_tensor((32, 2), 8, 68, version=1), "GGUF version 1 is not supported"),
    (_one_tensor((32, 2), 8, 68)[:30], "the header ends early"),
    (_one_tensor((32, 2), 8, 67), "tensor w ends past the end of the file"),
    (_one_tensor((48, 1), 8, 51), "tensor w: rows of 48 are not whole Q8_0 blocks of 32"),
    (_one_tensor((4,), 1000, 8), "tensor w has an unknown ggml type 1000"),
])
def test_a_file_that_is_not_whole_gguf_is_refused_with_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        read_gguf_index(str(path))
    # As the loader reports it: the file, then what is wrong with it.
    gguf_metadata._read_index_of_version.cache_clear()
    with pytest.raises(ValueError, match=f"cannot read the GGUF file {path}: {message}"):
        gguf_metadata._read_index(str(path))


def test_a_whole_hand_written_file_is_read(tmp_path):
    """The hand-written files above are refused only for what each breaks."""
    content = _one_tensor((32, 2), 8, 68)
    (tmp_path / "w.gguf").write_bytes(content)
    index = read_gguf_index(str(tmp_path / "w.gguf"))
    assert [(t.name, t.type_name, t.shape, t.offset, t.num_bytes) for t in index.tensors] == [
        ("w", "Q8_0", (2, 32), len(content) - 68, 68)]
    assert index.architecture == ""
