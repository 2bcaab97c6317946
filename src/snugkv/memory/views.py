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
