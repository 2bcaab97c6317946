"""A lean GGUF reader: metadata and tensor index in one pass, tensor data memory-mapped.

`gguf.GGUFReader` builds a Python object per array element, which takes seconds for the
tokenizer tables of a 49k-token vocabulary. Loading weights never needs those tables, so this
reader keeps string arrays as Python lists (one cheap pass) and numeric arrays as numpy views.
Dequantization and the type constants still come from the `gguf` package.

Format (little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64; then
`key: string, type: u32, value` pairs; then per tensor `name, n_dims u32, dims u64[n], type u32,
offset u64`; then the data section at the next multiple of `general.alignment` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
_SCALARS: dict[int, np.dtype[Any]] = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("?"),
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: the last dim is contiguous (GGUF lists dims reversed)
    ggml_type: int
    data_offset: int  # from the start of the file


class GGUFFile:
    """Metadata dict, tensor infos, and `raw(info)` views in the layout `gguf.quants.dequantize` takes."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            try:
                self._data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # an empty file cannot be mapped
                raise GGUFFormatError(f"{self.path} is empty, not a GGUF file") from exc
        self._pos = 0
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as exc:
            if isinstance(exc, GGUFFormatError):
                raise
            raise GGUFFormatError(f"{self.path} is truncated or corrupt ({exc})") from exc

    # -- parsing ------------------------------------------------------------------------
    def _unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self._pos + size > len(self._data):
            raise GGUFFormatError(f"{self.path} ends early (at byte {self._pos}); is the file complete?")
        value = struct.unpack_from(fmt, self._data, self._pos)[0]
        self._pos += size
        return value

    def _string(self) -> str:
        return self._strings(1)[0]

    def _strings(self, count: int) -> list[str]:
        """`count` strings in a row (a tokenizer's ~50k tokens and merges) in one loop, without a
        method call per string."""
        data, pos, end = self._data, self._pos, len(self._data)
        unpack, strings = struct.unpack_from, []
        for _ in range(count):
            if pos + 8 > end:
                raise GGUFFormatError(f"{self.path} ends early (at byte {pos}); is the file complete?")
            (length,) = unpack("<Q", data, pos)
            pos += 8
            if pos + length > end:
                raise GGUFFormatError(f"{self.path} ends inside a string; is the file complete?")
            strings.append(data[pos : pos + length].decode("utf-8", errors="replace"))
            pos += length
        self._pos = pos
        return strings

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<I"), self._unpack("<Q")
            if item_type == _STRING:
                return self._strings(count)
            if item_type not in _SCALARS:
                return [self._value(item_type) for _ in range(count)]
            dtype = _SCALARS[item_type]
            values = np.frombuffer(self._data, dtype=dtype, count=count, offset=self._pos)
            self._pos += dtype.itemsize * count
            return values.tolist() if count <= 64 else values
        if value_type not in _SCALARS:
            raise GGUFFormatError(f"{self.path}: unknown metadata value type {value_type}")
        dtype = _SCALARS[value_type]
        value = np.frombuffer(self._data, dtype=dtype, count=1, offset=self._pos)[0].item()
        self._pos += dtype.itemsize
        return value

    def _parse(self) -> None:
        if self._data[:4] != GGUF_MAGIC:
            raise GGUFFormatError(f"{self.path} is not a GGUF file (it does not start with b'GGUF')")
        self._pos = 4
        self.version = self._unpack("<I")
        if self.version not in (2, 3):
            raise GGUFFormatError(
                f"{self.path} is GGUF version {self.version}; versions 2 and 3 are supported"
            )
        tensor_count, kv_count = self._unpack("<Q"), self._unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            ggml_type, offset = self._unpack("<I"), self._unpack("<Q")
            infos.append((name, tuple(reversed(dims)), ggml_type, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [GGUFTensorInfo(n, s, t, start + o) for n, s, t, o in infos]
        self._check_complete()

    def _check_complete(self) -> None:
        """A file cut short in its data section says so now, not as a reshape error in a reader."""
        ends = [info.data_offset + size for info in self.tensors if (size := _data_bytes(info)) is not None]
        needed = max(ends, default=0)
        if needed > len(self._data):
            raise GGUFFormatError(
                f"{self.path} ends early: its tensors need {needed:,} bytes, the file has "
                f"{len(self._data):,}; is the file complete?"
            )

    # -- tensors ------------------------------------------------------------------------
    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as `gguf.quants.dequantize` expects them (a plain ndarray view)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        qtype = GGMLQuantizationType(info.ggml_type)
        dtype: np.dtype[Any]
        if qtype == GGMLQuantizationType.F32:
            dtype, shape = np.dtype("<f4"), info.shape
        elif qtype == GGMLQuantizationType.F16:
            dtype, shape = np.dtype("<f2"), info.shape
        elif qtype in GGML_QUANT_SIZES:
            dtype, shape = np.dtype(np.uint8), quant_shape_to_byte_shape(info.shape, qtype)
        else:
            raise GGUFFormatError(f"tensor {info.name} has unsupported type {qtype.name}")
        count = int(np.prod(shape))
        end = info.data_offset + count * dtype.itemsize
        if end > len(self._data):
            raise GGUFFormatError(
                f"{self.path}: tensor {info.name} runs past the end of the file; is it complete?"
            )
        flat = np.frombuffer(self._data, dtype=dtype, count=count, offset=info.data_offset)
        return flat.reshape(shape)

    def dequantize(self, info: GGUFTensorInfo) -> np.ndarray:
        """Float32 array of the tensor (a fresh, writable array)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        qtype = GGMLQuantizationType(info.ggml_type)
        try:
            values = dequantize(self.raw(info), qtype)
        except NotImplementedError as exc:
            raise GGUFFormatError(
                f"tensor {info.name} uses {qtype.name}, which cannot be dequantized"
            ) from exc
        return np.array(values, dtype=np.float32, copy=True)


def _data_bytes(info: GGUFTensorInfo) -> int | None:
    """Bytes of the tensor's data, or None for a type the `gguf` package does not know."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
    except (ValueError, KeyError):  # raw() names the type when the tensor is read
        return None
    return int(np.prod(info.shape)) // block_size * type_size
