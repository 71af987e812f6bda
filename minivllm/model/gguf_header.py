"""A strict pass over a GGUF file's header before anything else reads it.

The `gguf` package's reader (which reads the file afterwards, model/gguf_checkpoint.py) trusts the header: a
crafted array length makes it loop for hours, a tensor whose offset or size runs past the end yields a short
array that fails far from its cause, and dimensions whose product overflows 64 bits slip through. Readers of
this format have a history of such bugs, so every count, length, offset and size is checked here against the
file's size first, and a bad one is a ValueError naming the metadata key or tensor and what is wrong with it.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
_MAX_ELEMENTS = 1 << 48  # far above any tensor (a 405B model's largest is ~2^31 elements), far below overflow
# Scalar value types (GGUFValueType): struct format of each.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of the file, checked: its name, shape (ggml order: fastest dimension first), type, and the
    byte range of its data in the file."""

    name: str
    dims: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    start: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """What the strict pass found: the version, the metadata (values of the scalar and string entries; arrays
    only by key), the tensors, where the data begins."""

    version: int
    keys: tuple[str, ...]
    values: dict[str, int | float | bool | str]
    tensors: tuple[TensorInfo, ...]
    data_start: int
    alignment: int


class _Cursor:
    """Reads little-endian values from the mapped file; every read is checked against its end."""

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ValueError(f"GGUF {self.path}: {what} runs past the end of the file (needs {n} bytes at offset "
                             f"{self.pos}, the file has {self.size}): truncated or corrupt")

    def unpack(self, fmt: str, what: str) -> int | float | bool:
        n = struct.calcsize("<" + fmt)
        self.need(n, what)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return value

    def u32(self, what: str) -> int:
        return int(self.unpack("I", what))

    def u64(self, what: str) -> int:
        return int(self.unpack("Q", what))

    def string(self, what: str) -> str:
        n = self.u64(f"{what} (length)")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"GGUF {self.path}: {what} is not valid UTF-8") from None

    def skip_value(self, vtype: int, what: str, depth: int = 0) -> int | float | bool | str | None:
        """Step over one value of type vtype; scalars and strings are returned, arrays skipped."""
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            if depth:
                raise ValueError(f"GGUF {self.path}: {what} is an array of arrays (not part of the format)")
            itype, count = self.u32(f"{what} (element type)"), self.u64(f"{what} (length)")
            if itype in _SCALARS:
                self.need(count * struct.calcsize("<" + _SCALARS[itype]), f"{what} ({count} elements)")
                self.pos += count * struct.calcsize("<" + _SCALARS[itype])
            elif itype == _STRING:
                self.need(8 * count, f"{what} ({count} strings)")  # each at least its length field
                for i in range(count):
                    n = self.u64(f"{what}[{i}] (length)")
                    self.need(n, f"{what}[{i}]")
                    self.pos += n
            else:
                raise ValueError(f"GGUF {self.path}: {what} has unknown element type {itype}")
            return None
        raise ValueError(f"GGUF {self.path}: {what} has unknown value type {vtype}")


def read_header(path: str) -> GGUFHeader:
    """Check the whole header of a GGUF file against its size; raise ValueError naming the first problem."""
    size = os.path.getsize(path)
    if size < 24:
        raise ValueError(f"GGUF {path}: {size} bytes is too short for a GGUF header (truncated?)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(buf, path)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise ValueError(f"GGUF {path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r})")
        c.pos = 4
        version = c.u32("version")
        if version not in _VERSIONS:
            raise ValueError(f"GGUF {path}: version {version} is not supported (supported: {_VERSIONS}); a "
                             "big-endian file reads as a huge version")
        n_tensors, n_kv = c.u64("tensor count"), c.u64("metadata count")
        # Each metadata entry takes >= 13 bytes and each tensor info >= 24: counts above that cannot fit.
        if n_kv * 13 > size or n_tensors * 24 > size:
            raise ValueError(f"GGUF {path}: the header claims {n_kv} metadata entries and {n_tensors} tensors, "
                             f"more than a {size}-byte file can hold")
        keys: list[str] = []
        values: dict[str, int | float | bool | str] = {}
        alignment = 32
        for i in range(n_kv):
            key = c.string(f"metadata entry {i}'s key")
            if key in keys:
                raise ValueError(f"GGUF {path}: metadata key {key!r} appears twice")
            vtype = c.u32(f"metadata {key!r} (type)")
            value = c.skip_value(vtype, f"metadata {key!r}")
            if key == "general.alignment":
                if vtype != 4 or not isinstance(value, int) or value == 0 or value & (value - 1):
                    raise ValueError(f"GGUF {path}: metadata 'general.alignment' must be a uint32 power of two, "
                                     f"got {value!r}")
                alignment = value
            keys.append(key)
            if value is not None:
                values[key] = value
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = c.string(f"tensor info {i}'s name")
            if name in names:
                raise ValueError(f"GGUF {path}: tensor {name!r} appears twice")
            names.add(name)
            n_dims = c.u32(f"tensor {name!r} (dimension count)")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise ValueError(f"GGUF {path}: tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS} allowed)")
            dims = tuple(c.u64(f"tensor {name!r} (dimension {d})") for d in range(n_dims))
            raw_type = c.u32(f"tensor {name!r} (type)")
            offset = c.u64(f"tensor {name!r} (offset)")
            infos.append((name, dims, raw_type, offset))
        data_start = -(-c.pos // alignment) * alignment
    tensors = tuple(_check_tensor(path, size, data_start, alignment, *info) for info in infos)
    return GGUFHeader(version, tuple(keys), values, tensors, data_start, alignment)


def _check_tensor(path: str, size: int, data_start: int, alignment: int, name: str, dims: tuple[int, ...],
                  raw_type: int, offset: int) -> TensorInfo:
    try:
        ggml_type = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise ValueError(f"GGUF {path}: tensor {name!r} has unknown type {raw_type}") from None
    elements = 1
    for d in dims:
        if d < 1:
            raise ValueError(f"GGUF {path}: tensor {name!r} has a zero dimension {list(dims)}")
        elements *= d
        if elements > _MAX_ELEMENTS:
            raise ValueError(f"GGUF {path}: tensor {name!r}'s dimensions {list(dims)} overflow (over 2^48 elements)")
    if dims[0] % block:
        raise ValueError(f"GGUF {path}: tensor {name!r} of type {ggml_type.name} has rows of {dims[0]} values, not "
                         f"a multiple of its block of {block}")
    nbytes = elements // block * type_size
    if offset % alignment:
        raise ValueError(f"GGUF {path}: tensor {name!r}'s offset {offset} is not a multiple of the alignment "
                         f"{alignment}")
    start = data_start + offset
    if start + nbytes > size:
        raise ValueError(f"GGUF {path}: tensor {name!r} ({ggml_type.name}, {list(dims)}) needs bytes {start} to "
                         f"{start + nbytes}, past the end of the {size}-byte file: truncated or corrupt")
    return TensorInfo(name, dims, ggml_type, start, nbytes)
