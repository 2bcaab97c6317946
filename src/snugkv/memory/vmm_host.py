"""Host virtual-memory backend: Linux mmap, mprotect and madvise through ctypes.

This is a real virtual-memory system, not a mock: a reserved but uncommitted page is
PROT_NONE, so touching it faults; commit makes a span readable/writable and populates it;
decommit drops the pages (RSS falls) and protects them again. The CPU engine and the CI tests
run the whole post-capture pipeline on it. `capacity_bytes` plays the device's memory size,
so sizing on CPU has a bound and tests can make commits fail on purpose. A backend given a
`SharedHostDevice` also commits against that budget, shared with other processes (several engines
on one simulated device).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import threading

import torch

from snugkv.memory.host_device import SharedHostDevice
from snugkv.memory.vmm import CommitError, Extension, VirtualMemory, VmmError, VmmUnavailable, adjacent_spans

logger = logging.getLogger(__name__)

_PROT_NONE = 0
_PROT_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_PRIVATE_ANONYMOUS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_MAP_NORESERVE = 0x4000
_MADV_DONTNEED = 4
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels fall back to touching each page
_MAP_FAILED = ctypes.c_void_p(-1).value


def _load_libc() -> ctypes.CDLL:
    name = ctypes.util.find_library("c") or "libc.so.6"
    libc = ctypes.CDLL(name, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    for fn in (libc.munmap, libc.madvise, libc.mprotect):
        fn.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def available_ram_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise VmmError("/proc/meminfo has no MemAvailable line")


class HostVmm(VirtualMemory):
    """mmap-backed virtual memory on the CPU.

    `granularity_bytes` defaults to the OS page size; pass 2 MiB to mimic a GPU.
    `capacity_bytes` (default: RAM available at construction) bounds what this backend
    commits in total, like a device's memory; `shared` (optional) a budget it shares with other
    processes, which bounds it too.
    """

    name = "host"

    def __init__(
        self,
        granularity_bytes: int | None = None,
        capacity_bytes: int | None = None,
        shared: SharedHostDevice | None = None,
    ) -> None:
        if not hasattr(os, "sysconf") or not os.path.exists("/proc/meminfo"):
            raise VmmUnavailable("the host backend needs Linux (mmap, madvise and /proc/meminfo)")
        self._libc = _load_libc()
        self._page_bytes = mmap.PAGESIZE
        granularity = granularity_bytes or self._page_bytes
        if granularity % self._page_bytes:
            raise ValueError(
                f"granularity_bytes={granularity} must be a multiple of the page size {self._page_bytes}"
            )
        self._granularity_bytes = granularity
        self._capacity_bytes = capacity_bytes if capacity_bytes is not None else available_ram_bytes()
        self._committed_bytes = 0
        self._lock = threading.Lock()
        self._can_populate = True
        self._shared = shared
        self.device = torch.device("cpu")

    @property
    def granularity_bytes(self) -> int:
        return self._granularity_bytes

    @property
    def committed_bytes(self) -> int:
        return self._committed_bytes

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) under this backend's capacity; a capacity above what the machine can give
        counts only what it can (so free + committed == total, and a ledger adds up)."""
        available = available_ram_bytes()
        if self._shared is not None:
            available = min(available, self._shared.free_bytes())
        free = max(min(self._capacity_bytes - self._committed_bytes, available), 0)
        return free, min(self._capacity_bytes, self._committed_bytes + free)

    def _check(self, result: int, call: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise VmmError(f"{call} failed: errno {errno} ({os.strerror(errno)})")

    def reserve(self, size_bytes: int) -> int:
        size_bytes = self.align_up(size_bytes)
        # Over-reserve by one granule so the returned base can be granule-aligned.
        span = size_bytes + self._granularity_bytes
        flags = _MAP_PRIVATE_ANONYMOUS | _MAP_NORESERVE
        address = self._libc.mmap(None, span, _PROT_NONE, flags, -1, 0)
        if address in (None, _MAP_FAILED):
            errno = ctypes.get_errno()
            raise VmmError(f"mmap(PROT_NONE, {span} bytes) failed: errno {errno} ({os.strerror(errno)})")
        base = -(-address // self._granularity_bytes) * self._granularity_bytes
        if base > address:
            self._check(self._libc.munmap(address, base - address), "munmap(head slack)")
        tail = address + span - (base + size_bytes)
        if tail:
            self._check(self._libc.munmap(base + size_bytes, tail), "munmap(tail slack)")
        return base

    def commit(self, address: int, size_bytes: int) -> Extension:
        self._check_span(address, size_bytes)
        with self._lock:
            free, _ = self.mem_get_info()
            if size_bytes > free:
                raise CommitError(
                    f"commit of {size_bytes / 2**20:.1f} MiB refused: only {free / 2**20:.1f} MiB free "
                    f"under this host backend's capacity of {self._capacity_bytes / 2**30:.2f} GiB"
                    + ("" if self._shared is None else f" and the shared host device ({self._shared.path})")
                )
            if self._shared is not None:
                shared_free = self._shared.take(size_bytes)
                if size_bytes > shared_free:  # another process took it since mem_get_info
                    raise CommitError(
                        f"commit of {size_bytes / 2**20:.1f} MiB refused: only {shared_free / 2**20:.1f} MiB "
                        f"free on the shared host device ({self._shared.path})"
                    )
            try:
                self._check(
                    self._libc.mprotect(address, size_bytes, _PROT_READ_WRITE), "mprotect(READ|WRITE)"
                )
                self._populate(address, size_bytes)
            except VmmError:
                if self._shared is not None:
                    self._shared.give_back(size_bytes)
                raise
            self._committed_bytes += size_bytes
        return Extension(address, size_bytes, handle=None)

    def _populate(self, address: int, size_bytes: int) -> None:
        if self._can_populate:
            if self._libc.madvise(address, size_bytes, _MADV_POPULATE_WRITE) == 0:
                return
            errno_value = ctypes.get_errno()
            if errno_value != errno.EINVAL:  # the advice exists; the memory does not (ENOMEM, ...)
                self._libc.madvise(address, size_bytes, _MADV_DONTNEED)
                self._libc.mprotect(address, size_bytes, _PROT_NONE)
                raise CommitError(
                    f"backing {size_bytes / 2**20:.1f} MiB failed: errno {errno_value} "
                    f"({os.strerror(errno_value)}); the machine is short of memory"
                )
            self._can_populate = False  # EINVAL: a kernel older than 5.14; touch the pages instead
        ctypes.memset(address, 0, size_bytes)

    def decommit(self, extension: Extension) -> None:
        with self._lock:
            self._decommit_span(extension.address, extension.size_bytes)

    def decommit_many(self, extensions: list[Extension]) -> None:
        """Adjacent extensions go back in one `madvise` + `mprotect` per run of them."""
        with self._lock:
            for address, size_bytes in adjacent_spans(extensions):
                self._decommit_span(address, size_bytes)

    def _decommit_span(self, address: int, size_bytes: int) -> None:
        self._check(self._libc.madvise(address, size_bytes, _MADV_DONTNEED), "madvise(DONTNEED)")
        self._check(self._libc.mprotect(address, size_bytes, _PROT_NONE), "mprotect(NONE)")
        self._committed_bytes -= size_bytes
        if self._shared is not None:
            self._shared.give_back(size_bytes)

    def release(self, address: int, size_bytes: int) -> None:
        self._check(self._libc.munmap(address, self.align_up(size_bytes)), "munmap")

    def _check_span(self, address: int, size_bytes: int) -> None:
        granule = self._granularity_bytes
        if size_bytes <= 0 or address % granule or size_bytes % granule:
            raise ValueError(
                f"commit span (address=0x{address:x}, size={size_bytes}) must be positive and "
                f"aligned to the granularity {granule}"
            )
