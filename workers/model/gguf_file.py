"""A minimal GGUF (v2/v3) header reader: scalar metadata and zero-copy tensor views.

`gguf.GGUFReader` decodes every element of every array field into numpy views, which takes ~2 s
for a file with a 49k-token vocabulary; we need no array contents, only their lengths, so this
reader skips them and opens a file in milliseconds. Dequantization stays with `gguf.quants`.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from workers.model.config import ModelLoadError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# Scalar value types by GGUF type id: struct format (little-endian).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS.update({11: "<q", 12: "<d"})
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's raw bytes, shaped `[..., row_bytes]` as `gguf.quants.dequantize` expects."""

    name: str
    qtype: GGMLQuantizationType
    data: np.ndarray  # uint8 view into the file's memory map


@dataclass(frozen=True)
class GGUFFile:
    """Metadata (scalars and strings; arrays as their length) and tensors of one GGUF file."""

    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: dict[str, GGUFTensor]
    data_offset: int  # where tensor data starts
    mmap: np.ndarray  # the whole file, uint8


class _Cursor:
    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.pos = buf.data, 0  # a memoryview: struct reads it without copying

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        self.pos += length
        return self.buf[self.pos - length : self.pos].tobytes().decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        raise ModelLoadError(f"GGUF metadata has unknown value type {vtype}")

    def skip_array(self) -> int:
        """Step over an array value; returns its length."""
        item_type, length = self.scalar("<I"), self.scalar("<Q")
        if item_type in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[item_type]) * length
        else:
            for _ in range(length):
                if item_type == _ARRAY:
                    self.skip_array()
                else:
                    self.value(item_type)
        return int(length)


def read_gguf(path: Path) -> GGUFFile:
    """Parse `path`; raises ModelLoadError if it is not a readable little-endian GGUF v2/v3."""
    try:
        mmap = np.memmap(path, dtype=np.uint8, mode="r")
        return _parse(mmap)
    except (OSError, ValueError, struct.error, IndexError) as err:
        raise ModelLoadError(f"cannot read GGUF file {path}: {err}") from err


def _parse(mmap: np.ndarray) -> GGUFFile:
    cur = _Cursor(mmap)
    if bytes(mmap[:4]) != _MAGIC:
        raise ModelLoadError("not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ModelLoadError(f"GGUF version {version} unsupported (need 2 or 3, little-endian)")
    num_tensors, num_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    array_lengths: dict[str, int] = {}
    for _ in range(num_kv):
        key, vtype = cur.string(), cur.scalar("<I")
        if vtype == _ARRAY:
            array_lengths[key] = cur.skip_array()
        else:
            metadata[key] = cur.value(vtype)
    infos = []
    for _ in range(num_tensors):
        name, num_dims = cur.string(), cur.scalar("<I")
        dims = [cur.scalar("<Q") for _ in range(num_dims)]
        infos.append((name, dims, GGMLQuantizationType(cur.scalar("<I")), cur.scalar("<Q")))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = {name: _tensor(mmap, data_offset, *rest, name=name) for name, *rest in infos}
    return GGUFFile(metadata, array_lengths, tensors, data_offset, mmap)


def _tensor(
    mmap: np.ndarray,
    data_offset: int,
    dims: list[int],
    qtype: GGMLQuantizationType,
    offset: int,
    *,
    name: str,
) -> GGUFTensor:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    # GGUF lists dims fastest-first; a row is dims[0] elements, packed into blocks.
    row_bytes = dims[0] // block_size * type_size
    outer = [int(d) for d in reversed(dims[1:])]
    start = data_offset + offset
    data = mmap[start : start + math.prod(outer) * row_bytes].reshape(*outer, row_bytes)
    return GGUFTensor(name=name, qtype=qtype, data=data)
