"""Zero-copy torch tensors over raw addresses, through a DLPack capsule built with ctypes.

One code path for CPU and CUDA: the capsule names the device explicitly, so torch never asks
the driver about the pointer (it may point at reserved addresses that are not backed yet).
No compiler runs at start-up. Each tensor holds `owner` (the arena) alive until torch calls
the capsule's deleter, which happens when the last tensor sharing that storage dies; the
arena counts live views through `on_release`.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch

_DL_CPU = 1
_DL_CUDA = 2
_DL_UINT = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
]

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# Live capsules by id: each entry keeps its ctypes structs, its owner and its release
# callback alive until torch calls the deleter.
_live: dict[int, tuple[Any, ...]] = {}
_live_lock = threading.Lock()
_ids = itertools.count(1)


def _on_delete(managed: ctypes._Pointer) -> None:
    try:
        with _live_lock:
            entry = _live.pop(managed.contents.manager_ctx, None)
        if entry is not None:
            entry[-1]()
    except Exception:  # a deleter must never raise into torch
        pass


_deleter = _DELETER(_on_delete)  # module-level: lives as long as the interpreter


def byte_view(
    address: int, size_bytes: int, device: torch.device, owner: object, on_release: Callable[[], None]
) -> torch.Tensor:
    """A uint8 tensor of `size_bytes` at `address` on `device`, keeping `owner` alive."""
    if size_bytes <= 0:
        raise ValueError(f"a view needs a positive size, got {size_bytes} bytes")
    shape = (ctypes.c_int64 * 1)(size_bytes)
    managed = _DLManagedTensor()
    managed.dl_tensor.data = address
    if device.type == "cuda":
        managed.dl_tensor.device = _DLDevice(_DL_CUDA, device.index or 0)
    elif device.type == "cpu":
        managed.dl_tensor.device = _DLDevice(_DL_CPU, 0)
    else:
        raise ValueError(f"no zero-copy views on device type {device.type!r}")
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DLDataType(_DL_UINT, 8, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = None
    managed.dl_tensor.byte_offset = 0
    key = next(_ids)
    managed.manager_ctx = key
    managed.deleter = _deleter
    with _live_lock:
        _live[key] = (managed, shape, owner, on_release)
    capsule = _PyCapsule_New(ctypes.addressof(managed), b"dltensor", None)
    return torch.utils.dlpack.from_dlpack(capsule)


def typed_view(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Reinterpret a uint8 view as `dtype` with `shape` (fp8 included), without copying."""
    return raw.view(dtype).view(shape)


WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def words_fit(rows: torch.Tensor, word_bytes: int) -> bool:
    """Whether a `[rows, row bytes]` uint8 tensor can be seen as rows of `word_bytes`-byte words
    (each row's bytes contiguous; its length, stride and address multiples of the word)."""
    return (
        rows.stride(1) == 1
        and rows.stride(0) % word_bytes == 0
        and rows.shape[1] % word_bytes == 0
        and rows.data_ptr() % word_bytes == 0
    )


def widest_words(raw: torch.Tensor) -> torch.Tensor:
    """`raw` (a contiguous buffer's bytes, one row per slot or page along dim 0) as rows of the
    widest word (8, 4 or 2 bytes) its rows and address allow, or `raw` itself: a gather or scatter
    of 1-byte elements moves each row byte by byte (the H100 run at 41cd5be moved 4 GiB of live KV
    in ~28 ms where the copy at bandwidth takes 2.9 ms)."""
    if not raw.is_contiguous():
        return raw
    rows = raw.view(raw.shape[0], -1)
    for word in (8, 4, 2):
        if words_fit(rows, word):
            return rows.view(WORD_DTYPES[word])
    return raw
