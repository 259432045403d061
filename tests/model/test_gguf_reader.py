"""pagedllm.model.gguf_reader against gguf-py's GGUFReader, the reference it replaces on the load path."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from pagedllm.model.gguf_reader import GGUFArray, read_gguf
from pagedllm.model.loader import default_model_path


def _assert_same_as_gguf_py(path: str | Path) -> None:
    """Every metadata value and every tensor (name, type, shape, data) as gguf-py reads them."""
    ours, reference = read_gguf(path), GGUFReader(path)
    fields = {key: field for key, field in reference.fields.items() if not key.startswith("GGUF.")}
    assert set(ours.metadata) == set(fields)
    for key, field in fields.items():
        value = ours.metadata[key]
        if field.types[0] == GGUFValueType.ARRAY:
            assert value == GGUFArray(len(field.data)), key
        elif field.types[0] == GGUFValueType.STRING:
            assert value == bytes(field.parts[field.data[0]]).decode("utf-8"), key
        else:
            expected = field.parts[field.data[0]][0].item()
            assert (value, type(value)) == (expected, type(expected)), key
    assert [tensor.name for tensor in ours.tensors] == [tensor.name for tensor in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.shape == tuple(int(size) for size in theirs.shape), mine.name
        assert (mine.data.dtype, mine.data.shape) == (theirs.data.dtype, theirs.data.shape), mine.name
        assert np.array_equal(mine.data, theirs.data), mine.name
        assert not mine.data.flags.writeable, mine.name  # a view of the read-only mapping


def test_default_model_reads_as_gguf_py_reads_it():
    _assert_same_as_gguf_py(default_model_path())


@pytest.fixture
def every_value_type(tmp_path) -> Path:
    """A GGUF with each metadata value type, arrays of numbers and strings, odd alignment, and tensors."""
    path = tmp_path / "values.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -7)
    writer.add_float32("t.f32", 1e-5)  # not exact in float32: read back as float32's value
    writer.add_uint64("t.u64", 2**40)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "ünïcode 你好")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.strs", ["a", "bc", ""])
    writer.add_custom_alignment(64)
    writer.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("f16", np.ones(5, dtype=np.float16))
    writer.add_tensor("q8", np.full((2, 34), 7, dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_value_type_reads_as_gguf_py_reads_it(every_value_type):
    _assert_same_as_gguf_py(every_value_type)
    file = read_gguf(every_value_type)
    assert file.metadata["t.str"] == "ünïcode 你好"
    assert file.metadata["t.strs"] == GGUFArray(3)
    assert file.metadata["general.alignment"] == 64
    assert file.tensors[2].data.shape == (2, 34)  # Q8_0: one 34-byte block per row of 32


def _bad(tmp_path: Path, content: bytes) -> Path:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("content, message", [
    (b"", "empty"),
    (b"GGML" + bytes(60), "magic"),
    (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "version 1"),
    (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1), "ends inside its header"),  # one key promised, none there
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 99) + b"key", "past the end"),
])
def test_malformed_files_raise_value_error(tmp_path, content, message):
    with pytest.raises(ValueError, match=message):
        read_gguf(_bad(tmp_path, content))


def test_truncated_tensor_data_raises(every_value_type, tmp_path):
    content = every_value_type.read_bytes()
    last = read_gguf(every_value_type).tensors[-1].data
    data_end = content.rindex(last.tobytes()) + last.nbytes  # the last tensor ends here; padding follows
    with pytest.raises(ValueError, match="runs past the end of the file"):
        read_gguf(_bad(tmp_path, content[:data_end - 1]))
