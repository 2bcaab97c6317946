"""CUDA virtual-memory backend over NVIDIA's driver bindings (`cuda.bindings.driver`).

Every driver call is checked; a failure names the call and the CUresult. A commit is one
`cuMemCreate` + `cuMemMap` + `cuMemSetAccess` for the whole span (one handle per extension,
never a loop over 2 MiB chunks); a commit of several pieces maps each and sets access once over
them all. If map or set-access fails, what was created is unmapped and released before the error
propagates, so nothing stays half-mapped. Decommitting only unmaps and releases: it never
allocates, so memory can always be given back. Importing this module
needs cuda-bindings but no driver: the driver is first touched in `probe_vmm_support`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from cuda.bindings import driver as drv

from snugkv.memory.vmm import CommitError, Extension, VirtualMemory, VmmError, VmmUnavailable

logger = logging.getLogger(__name__)


def _error_name(err: Any) -> str:
    try:
        status, name = drv.cuGetErrorName(err)
        if status == drv.CUresult.CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # naming the error must never hide it
        pass
    return str(err)


def _check(result: Any, call: str) -> Any:
    """Unpack a driver call's `(CUresult, value...)` tuple, raising on failure."""
    err = result[0] if isinstance(result, tuple) else result
    if err != drv.CUresult.CUDA_SUCCESS:
        exc = CommitError if err == drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY else VmmError
        raise exc(f"{call} failed: {_error_name(err)} (CUresult {int(err)})")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


def probe_vmm_support(device: torch.device) -> tuple[bool, str]:
    """Whether the driver can do VMM on `device`, with the reason when it cannot."""
    try:
        _check(drv.cuInit(0), "cuInit")
        cu_device = _check(drv.cuDeviceGet(device.index or 0), "cuDeviceGet")
        attribute = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        supported = _check(drv.cuDeviceGetAttribute(attribute, cu_device), "cuDeviceGetAttribute")
    except VmmError as exc:
        return False, str(exc)
    except Exception as exc:  # e.g. cuda.pathfinder's DynamicLibNotFoundError: no driver
        return False, f"the CUDA driver library could not be loaded ({type(exc).__name__}: {exc})"
    if not supported:
        return False, f"{device} does not support virtual memory management (driver too old?)"
    return True, "ok"


class CudaVmm(VirtualMemory):
    """VMM over one CUDA device, in the primary context that torch uses."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        ok, reason = probe_vmm_support(device)
        if not ok:
            raise VmmUnavailable(reason)
        self.device = torch.device(
            "cuda", device.index if device.index is not None else torch.cuda.current_device()
        )
        with torch.cuda.device(self.device):
            torch.zeros(1, device=self.device)  # makes torch's primary context exist and current
            self._context = _check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        self._lock = threading.Lock()
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device.index
        self._prop = prop
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device.index
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self._granularity_bytes = int(
            _check(drv.cuMemGetAllocationGranularity(prop, flag), "cuMemGetAllocationGranularity")
        )

    @property
    def granularity_bytes(self) -> int:
        return self._granularity_bytes

    def _make_current(self) -> None:
        _check(drv.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def reserve(self, size_bytes: int) -> int:
        self._make_current()
        size_bytes = self.align_up(size_bytes)
        address = _check(
            drv.cuMemAddressReserve(size_bytes, self._granularity_bytes, 0, 0),
            f"cuMemAddressReserve({size_bytes} bytes)",
        )
        return int(address)

    def commit(self, address: int, size_bytes: int) -> Extension:
        if size_bytes <= 0 or address % self._granularity_bytes or size_bytes % self._granularity_bytes:
            raise ValueError(
                f"commit span (0x{address:x}, {size_bytes}) must be positive and granularity-aligned"
            )
        with self._lock:
            self._make_current()
            handle = _check(drv.cuMemCreate(size_bytes, self._prop, 0), f"cuMemCreate({size_bytes} bytes)")
            mapped = False
            try:
                _check(drv.cuMemMap(address, size_bytes, 0, handle, 0), "cuMemMap")
                mapped = True
                _check(drv.cuMemSetAccess(address, size_bytes, [self._access], 1), "cuMemSetAccess")
            except VmmError as exc:
                if mapped:
                    drv.cuMemUnmap(address, size_bytes)
                drv.cuMemRelease(handle)
                raise CommitError(f"{exc}; the {size_bytes} bytes created were released again") from exc
        return Extension(address, size_bytes, handle)

    def decommit(self, extension: Extension) -> None:
        with self._lock:
            self._make_current()
            _check(drv.cuMemUnmap(extension.address, extension.size_bytes), "cuMemUnmap")
            _check(drv.cuMemRelease(extension.handle), "cuMemRelease")

    def decommit_many(self, extensions: list[Extension]) -> None:
        """One lock and one context switch for the whole batch, then unmap and release each."""
        with self._lock:
            self._make_current()
            for extension in extensions:
                _check(drv.cuMemUnmap(extension.address, extension.size_bytes), "cuMemUnmap")
                _check(drv.cuMemRelease(extension.handle), "cuMemRelease")

    def commit_pieces(self, address: int, sizes_bytes: list[int]) -> list[Extension]:
        """One `cuMemCreate` + `cuMemMap` per piece, then one `cuMemSetAccess` over the whole span
        (the driver takes a range of several mappings): a grow of thousands of small extensions
        pays the access call once. All or none, as `commit`."""
        granule = self._granularity_bytes
        if address % granule or any(size <= 0 or size % granule for size in sizes_bytes):
            raise ValueError(f"commit pieces from 0x{address:x} must be positive and granularity-aligned")
        made: list[Extension] = []
        with self._lock:
            self._make_current()
            try:
                start = address
                for size in sizes_bytes:
                    handle = _check(drv.cuMemCreate(size, self._prop, 0), f"cuMemCreate({size} bytes)")
                    try:
                        _check(drv.cuMemMap(start, size, 0, handle, 0), "cuMemMap")
                    except VmmError:
                        drv.cuMemRelease(handle)
                        raise
                    made.append(Extension(start, size, handle))
                    start += size
                span = start - address
                _check(drv.cuMemSetAccess(address, span, [self._access], 1), "cuMemSetAccess")
            except VmmError as exc:
                for extension in reversed(made):
                    drv.cuMemUnmap(extension.address, extension.size_bytes)
                    drv.cuMemRelease(extension.handle)
                total = sum(sizes_bytes)
                raise CommitError(f"{exc}; the {total} bytes asked for were released again") from exc
        return made

    def release(self, address: int, size_bytes: int) -> None:
        self._make_current()
        _check(drv.cuMemAddressFree(address, self.align_up(size_bytes)), "cuMemAddressFree")
