"""A GGUF file's metadata and tensor table, read in milliseconds.

gguf-py's ``GGUFReader`` builds a numpy view for every part of every metadata value; a vocabulary of
49k tokens and its 49k merges make that ~2 s, most of a cold start on a small model. This reader
walks the same layout with ``struct`` over an ``mmap`` and keeps only what loading needs:

- scalar and string values as Python values; arrays as ``GGUFArray`` (their element count only: the
  tokenizer, the one user of the big string arrays, is built by transformers from the file itself);
- every tensor as a ``GGUFTensor`` whose ``data`` is a read-only numpy view of the mapping (nothing
  is read from disk until a weight is decoded), shaped as gguf-py's ``ReaderTensor.data``.

Safety rules: a file that is not little-endian GGUF v2/v3, that is cut short, or whose tensor table
is inconsistent (a repeated name, an unknown type, data past the end of the file) raises
``ValueError``; nothing here writes to the mapping.
"""

from __future__ import annotations

import mmap
import struct
from math import prod
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # v1 counted in 32 bits; no file in use still has it
_DEFAULT_ALIGNMENT = 32  # llama.cpp's, when general.alignment is absent
_STRING, _ARRAY = 8, 9  # the two variable-length metadata value types
# The fixed-size metadata value types: u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
# gguf-py hands these types' data over as typed values; every other type as its raw bytes.
_VALUE_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


class GGUFArray(NamedTuple):
    """A metadata array, known by its length only (no supported model needs an array's values)."""

    length: int


class GGUFTensor(NamedTuple):
    """One tensor of the file, with the fields of gguf-py's ``ReaderTensor`` that loading reads."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    data: np.ndarray  # read-only view: values for F32/F16, block bytes [..., bytes per row] otherwise


class GGUFFile(NamedTuple):
    """What ``read_gguf`` found: metadata by key and the tensors in file order."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse ``path``'s metadata and tensor table; ValueError when it is not a readable GGUF file."""
    with open(path, "rb") as file:
        try:
            blob = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as error:  # an empty file cannot be mapped
            raise ValueError(f"{str(path)!r} is empty") from error
    try:
        return _parse(blob)
    except struct.error as error:  # a length or count that runs past the end of the file
        raise ValueError(f"the file ends inside its header ({error})") from error


def _parse(blob: mmap.mmap) -> GGUFFile:
    if blob[:4] != _MAGIC:
        raise ValueError("it does not start with the GGUF magic bytes")
    version, tensor_count, metadata_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in _VERSIONS:
        # A big-endian file shows its version byte-swapped (its low 16 bits are zero).
        kind = "a big-endian GGUF file" if version & 0xFFFF == 0 else f"GGUF version {version}"
        raise ValueError(f"it is {kind}; only little-endian versions {_VERSIONS} are read")
    metadata, position = {}, 24
    for _ in range(metadata_count):
        key, position = _string(blob, position)
        (value_type,) = struct.unpack_from("<I", blob, position)
        metadata[key], position = _value(blob, position + 4, value_type)
    table, position = _tensor_table(blob, tensor_count, position)
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-position // alignment) * alignment  # the next aligned offset after the table
    return GGUFFile(metadata, [_tensor(blob, data_start, *entry) for entry in table])


def _string(blob: mmap.mmap, position: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, position)
    end = position + 8 + length
    if end > len(blob):
        raise ValueError("a string runs past the end of the file")
    return blob[position + 8:end].decode("utf-8"), end


def _value(blob: mmap.mmap, position: int, value_type: int) -> tuple[Any, int]:
    """One metadata value and the offset just past it."""
    if value_type in _SCALAR_FORMATS:
        value_format = _SCALAR_FORMATS[value_type]
        return struct.unpack_from(value_format, blob, position)[0], position + struct.calcsize(value_format)
    if value_type == _STRING:
        return _string(blob, position)
    if value_type != _ARRAY:
        raise ValueError(f"a metadata value has unknown type {value_type}")
    element_type, length = struct.unpack_from("<IQ", blob, position)
    position += 12
    if element_type in _SCALAR_FORMATS:
        return GGUFArray(length), position + length * struct.calcsize(_SCALAR_FORMATS[element_type])
    for _ in range(length):  # strings or nested arrays: variable length, so each is walked
        position = _value(blob, position, element_type)[1]
    return GGUFArray(length), position


def _tensor_table(blob: mmap.mmap, count: int, position: int) -> tuple[list[tuple], int]:
    """``[(name, GGUF-order shape, type id, offset in the data section)]`` and the offset after it."""
    table = []
    for _ in range(count):
        name, position = _string(blob, position)
        (dimensions,) = struct.unpack_from("<I", blob, position)
        if dimensions == 0:
            raise ValueError(f"tensor {name!r} has no dimensions")
        shape = struct.unpack_from(f"<{dimensions}Q", blob, position + 4)
        position += 4 + 8 * dimensions
        type_id, offset = struct.unpack_from("<IQ", blob, position)
        table.append((name, shape, type_id, offset))
        position += 12
    names = [entry[0] for entry in table]
    if len(set(names)) != len(names):
        raise ValueError("a tensor name appears twice")
    return table, position


def _tensor(blob: mmap.mmap, data_start: int, name: str, shape: tuple[int, ...], type_id: int,
            offset: int) -> GGUFTensor:
    tensor_type = GGMLQuantizationType(type_id)  # ValueError for an id ggml does not know
    block_size, block_bytes = GGML_QUANT_SIZES[tensor_type]
    torch_order = tuple(reversed(shape))
    if torch_order[-1] % block_size:
        raise ValueError(f"tensor {name!r} has rows of {torch_order[-1]} values, not whole {tensor_type.name} blocks")
    nbytes = prod(shape) // block_size * block_bytes
    start = data_start + offset
    if start + nbytes > len(blob):
        raise ValueError(f"tensor {name!r} runs past the end of the file")
    if tensor_type in _VALUE_DTYPES:
        dtype, data_shape = _VALUE_DTYPES[tensor_type], torch_order
    else:
        dtype, data_shape = np.uint8, (*torch_order[:-1], torch_order[-1] // block_size * block_bytes)
    data = np.frombuffer(blob, dtype=np.uint8, count=nbytes, offset=start).view(dtype).reshape(data_shape)
    return GGUFTensor(name, tensor_type, tuple(shape), data)
