"""Reads a GGUF file's header (key-value metadata and tensor index) in one pass, fast.

`read_header(path)` returns a `GGUFHeader`: the metadata as plain Python values and a
`TensorInfo` per tensor whose `data` is a read-only memory-mapped view of its bytes. The format
(https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic, version, tensor count, key
count; each key a string (uint64 length + UTF-8 bytes), a uint32 value type and the value (a
scalar, a string, or an array: element type, uint64 count, elements); then each tensor's name,
dims (innermost first), type and offset; the data starts at the next multiple of
`general.alignment` (32).

Why not `gguf.GGUFReader` (gguf 0.19.0, the newest release; it has no option to skip or defer
the metadata): its constructor parses every array element by element, one numpy memmap view per
number and two per string. For the default model's vocabulary (49,152 tokens and ~48,900
merges) that is ~1.2M views and 2-4 s, over half of `load_checkpoint("default")`. Here a string
is one `struct.unpack_from` and one `bytes.decode`, and a numeric array one `numpy.frombuffer`:
~0.05 s for the same header. The other options measured or weighed: an on-disk cache of the
parsed metadata keyed by path, size and mtime helps only from the second load, adds a folder
to keep consistent, and still needs the tensor index parsed; a lazily built `GGUFReader` cannot
skip the metadata it is slow on. This parse is exact on the first load and stateless.

Exactness: values are the ones `gguf_reader` makes from a `GGUFReader`'s fields (strings
decoded as UTF-8, bad bytes replaced with a warning; FLOAT32 scalars as the shortest decimal
that round-trips; arrays as lists), and tensors have the same type, dims, offset and data view.
Whatever this reader does not handle exactly as `GGUFReader` does (nested arrays, the other
byte order, a version other than 2 or 3, and any malformed or truncated byte) raises
`FastPathError`; `read_gguf` then reads the file with `GGUFReader`, so odd files read, and
broken ones fail, exactly as before. Tests compare both readers field by field.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Names GGUFReader gives the header's own counters among its fields (never in the metadata).
READER_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")

# Little-endian numpy dtype of each scalar value type.
_SCALAR_DTYPES: dict[int, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"), GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"), GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"), GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"), GGUFValueType.BOOL: np.dtype("?"),
    GGUFValueType.UINT64: np.dtype("<u8"), GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
# Tensor types GGUFReader maps to numpy element types (all others: raw bytes per row).
_ELEMENT_DTYPES: dict[GGMLQuantizationType, type[np.generic]] = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_COUNTS = struct.Struct("<QQ")


class FastPathError(ValueError):
    """The file is not one this reader reads exactly like `gguf.GGUFReader` (malformed, or a
    rare form such as nested arrays): read it with `GGUFReader` instead."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file (the fields of `gguf.ReaderTensor` that readers use).

    `dims`: GGUF order, innermost first (numpy's shape reversed). `data`: a read-only view of
    the file's bytes, as `GGUFReader` shapes it: `[..., dims[0]]` of the element type for
    F16/F32/F64/I8-I64, else uint8 `[..., bytes per row]`.
    """

    name: str
    tensor_type: GGMLQuantizationType
    dims: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray

    @classmethod
    def from_reader(cls, t: Any) -> TensorInfo:
        """The same information from a `gguf.ReaderTensor`."""
        return cls(t.name, t.tensor_type, tuple(int(d) for d in t.shape.tolist()),
                   int(t.n_elements), int(t.n_bytes), int(t.data_offset), t.data)

    @property
    def numpy_shape(self) -> tuple[int, ...]:
        """The tensor's shape in numpy (HF) order, e.g. `[out, in]`."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's metadata (key -> plain Python value, in file order) and tensors."""

    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int


def decode_text(raw: bytes, key: str) -> str:
    """`raw` as UTF-8; bad bytes are replaced (with a warning naming the metadata `key`)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        log.warning("GGUF field %s holds a string that is not UTF-8; replacing bad bytes", key)
        return raw.decode("utf-8", errors="replace")


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parses the header of the GGUF file at `path`; raises `FastPathError` for any file this
    reader does not read exactly as `gguf.GGUFReader` would (see the module docstring), and
    `OSError` when the file cannot be opened."""
    path = Path(path)
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise FastPathError("shorter than a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _Parser(buf, path).header()
            except (struct.error, ValueError, KeyError, IndexError, OverflowError) as e:
                if isinstance(e, FastPathError):
                    raise
                raise FastPathError(f"{type(e).__name__}: {e}") from None


class _Parser:
    """Reads `buf` (the whole file) from the start; `pos` is the next byte."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf = buf
        self.path = path
        self.pos = 0

    def header(self) -> GGUFHeader:
        buf = self.buf
        if buf[:4] != GGUF_MAGIC:
            raise FastPathError("bad magic")
        version = _U32.unpack_from(buf, 4)[0]
        if version & 0xFFFF == 0 or version not in SUPPORTED_VERSIONS:
            raise FastPathError(f"version {version} (or the other byte order)")
        n_tensors, n_kv = _COUNTS.unpack_from(buf, 8)
        self.pos = 24
        metadata: dict[str, Any] = {}
        seen = set(READER_FIELDS)
        for _ in range(n_kv):
            key = self.string().decode("utf-8")
            if key in seen:
                raise FastPathError(f"duplicate key {key!r}")
            seen.add(key)
            kind = self.u32()
            value = self.value(kind, key)
            if key == "general.alignment" and kind != GGUFValueType.UINT32:
                raise FastPathError("bad type for general.alignment")
            if not key.startswith("GGUF."):
                metadata[key] = value
        entries = [self.tensor_entry() for _ in range(n_tensors)]
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment == 0 or alignment & (alignment - 1):
            raise FastPathError(f"alignment {alignment} is not a power of two")
        data_offset = -(-self.pos // alignment) * alignment
        tensors = self.tensors(entries, data_offset)
        return GGUFHeader(int(version), metadata, tensors, alignment, data_offset)

    def u32(self) -> int:
        value = _U32.unpack_from(self.buf, self.pos)[0]
        self.pos += 4
        return value

    def u64(self) -> int:
        value = _U64.unpack_from(self.buf, self.pos)[0]
        self.pos += 8
        return value

    def string(self) -> bytes:
        n = self.u64()
        raw = self.buf[self.pos:self.pos + n]
        if len(raw) != n:
            raise FastPathError("truncated string")
        self.pos += n
        return raw

    def value(self, kind: int, key: str) -> Any:
        """One value of type `kind`, as `gguf_reader` turns a GGUFReader field into Python."""
        if kind == GGUFValueType.STRING:
            return decode_text(self.string(), key)
        if kind in _SCALAR_DTYPES:
            scalar = self.array(_SCALAR_DTYPES[kind], 1)[0]
            if kind == GGUFValueType.FLOAT32:
                return float(str(scalar))  # shortest decimal that round-trips: 1e-05
            return scalar.item()
        if kind != GGUFValueType.ARRAY:
            raise FastPathError(f"unknown value type {kind}")
        inner, count = self.u32(), self.u64()
        if count == 0:
            return []
        if inner == GGUFValueType.STRING:
            return self.strings(count, key)
        if inner in _SCALAR_DTYPES:
            return self.array(_SCALAR_DTYPES[inner], count).tolist()
        raise FastPathError(f"array of value type {inner} (nested arrays: GGUFReader flattens)")

    def array(self, dtype: np.dtype, count: int) -> np.ndarray:
        end = self.pos + dtype.itemsize * count
        if end > len(self.buf):
            raise FastPathError("truncated array")
        values = np.frombuffer(self.buf, dtype, count, self.pos)
        self.pos = end
        return values

    def strings(self, count: int, key: str) -> list[str]:
        """`count` strings in one loop (the vocabulary: ~50k of them)."""
        buf, pos, size = self.buf, self.pos, len(self.buf)
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            n = unpack(buf, pos)[0]
            end = pos + 8 + n
            if end > size:
                raise FastPathError("truncated string array")
            raw = buf[pos + 8:end]
            try:
                append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                append(decode_text(raw, key))
            pos = end
        self.pos = pos
        return out

    def tensor_entry(self) -> tuple[str, tuple[int, ...], int, int]:
        """(name, dims, raw type, offset in the data section) of the next tensor."""
        name = self.string().decode("utf-8")
        n_dims = self.u32()
        dims = tuple(int(d) for d in self.array(np.dtype("<u8"), n_dims))
        return name, dims, self.u32(), self.u64()

    def tensors(self, entries: list[tuple[str, tuple[int, ...], int, int]],
                data_offset: int) -> list[TensorInfo]:
        file = np.memmap(self.path, mode="r")
        out: list[TensorInfo] = []
        names: set[str] = set()
        for name, dims, raw_type, offset in entries:
            if name in names:
                raise FastPathError(f"duplicate tensor {name!r}")
            names.add(name)
            ggml_type = GGMLQuantizationType(raw_type)
            n_elements = math.prod(dims)
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            n_bytes = n_elements * type_size // block_size
            start = data_offset + offset
            if start + n_bytes > len(file):
                raise FastPathError(f"tensor {name!r} runs past the end of the file")
            shape: tuple[int, ...] = tuple(reversed(dims))
            element = _ELEMENT_DTYPES.get(ggml_type)
            if element is None:
                element, shape = np.uint8, quant_shape_to_byte_shape(shape, ggml_type)
            data = file[start:start + n_bytes].view(element).reshape(shape)
            out.append(TensorInfo(name, ggml_type, dims, n_elements, n_bytes, start, data))
        return out
