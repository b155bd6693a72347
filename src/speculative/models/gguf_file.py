"""A GGUF file's metadata and tensor table, read straight from its header.

gguf's ``GGUFReader`` builds numpy views of every part of every metadata field, so the
default model's 49,152-token vocabulary and its merges took it about 4 s on a 2-core
Zen 2, and a load read the file twice (once to find the stored precision, once for the
weights). This reads the same header with ``struct`` (0.08 s there) and leaves the tensor
data in a read-only memory map until a tensor's ``data`` is used.

Format (little-endian, versions 2 and 3): magic ``GGUF``, uint32 version, uint64 tensor
count, uint64 metadata count; each metadata entry a string key, a uint32 value type and
the value (strings: uint64 length + UTF-8 bytes; arrays: uint32 item type, uint64 count,
items); each tensor a string name, uint32 dimension count, uint64 dimensions (innermost
first), uint32 ggml type and uint64 offset into the data section, which starts at the next
multiple of ``general.alignment`` (32 unless given) after the table.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
STRING, ARRAY = 8, 9
# value type -> struct format of one item
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}  # fmt: skip
# ggml types stored as plain numbers (the rest are blocks of bytes)
PLAIN = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array: its item type and length (the items are skipped, not read)."""

    item_type: int
    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the table, as gguf's reader gives it: ``shape`` in GGUF order
    (innermost first); ``data`` a memory-mapped view, typed for plain types ([*reversed
    shape]) and uint8 blocks for quantized ones ([..., bytes per row])."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata (scalars and strings as values, arrays as
    :class:`GGUFArray`) and its tensors, in file order."""

    fields: dict[str, object]
    tensors: list[GGUFTensor]


class _Cursor:
    """Reads little-endian values from a buffer, moving forward."""

    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer = buffer
        self.at = 0

    def scalar(self, fmt: str) -> int | float | bool:
        (value,) = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = int(self.scalar("<Q"))
        text = bytes(self.buffer[self.at : self.at + length]).decode("utf-8", errors="replace")
        self.at += length
        return text

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", self.buffer, self.at)
            self.at += 8 + length

    def value(self, kind: int) -> object:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item_type, count = int(self.scalar("<I")), int(self.scalar("<Q"))
            if item_type == STRING:
                self.skip_strings(count)
            elif item_type in SCALARS:
                self.at += count * struct.calcsize(SCALARS[item_type])
            else:
                raise ValueError(f"arrays of GGUF type {item_type} are not supported")
            return GGUFArray(item_type, count)
        if kind not in SCALARS:
            raise ValueError(f"unknown GGUF metadata type {kind}")
        return self.scalar(SCALARS[kind])


def read_gguf(path: str | Path) -> GGUFFile:
    """The metadata and tensor table of the GGUF file at ``path`` (ValueError when it is
    not one, or is cut short)."""
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    if bytes(buffer[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it does not start with {MAGIC!r})")
    cursor = _Cursor(buffer)
    cursor.at = 4
    try:
        version = int(cursor.scalar("<I"))
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        tensor_count, field_count = int(cursor.scalar("<Q")), int(cursor.scalar("<Q"))
        fields = {}
        for _ in range(field_count):
            key = cursor.string()
            fields[key] = cursor.value(int(cursor.scalar("<I")))
        table = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = tuple(int(cursor.scalar("<Q")) for _ in range(int(cursor.scalar("<I"))))
            table.append((name, dims, int(cursor.scalar("<I")), int(cursor.scalar("<Q"))))
    except struct.error as error:
        raise ValueError(f"{path}: the GGUF header is cut short ({error})") from None
    names = [entry[0] for entry in table]
    if len(set(names)) < len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise ValueError(f"{path}: tensor {twice!r} appears more than once")
    alignment = int(fields.get("general.alignment", 32))  # type: ignore[call-overload]
    start = -(-cursor.at // alignment) * alignment
    return GGUFFile(fields, [_tensor(buffer, start, *entry) for entry in table])


def _tensor(
    buffer: np.ndarray, start: int, name: str, dims: tuple[int, ...], kind: int, offset: int
) -> GGUFTensor:
    ggml_type = GGMLQuantizationType(kind)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    elements = int(np.prod(dims))
    size = elements * type_size // block_size
    at = start + offset
    if at + size > buffer.shape[0]:
        raise ValueError(f"tensor {name!r} runs past the end of the file")
    raw = buffer[at : at + size]
    shape = tuple(reversed(dims))
    if ggml_type in PLAIN:
        data = raw.view(PLAIN[ggml_type]).reshape(shape)
    else:
        data = raw.reshape(quant_shape_to_byte_shape(shape, ggml_type))
    return GGUFTensor(name, ggml_type, dims, data)
