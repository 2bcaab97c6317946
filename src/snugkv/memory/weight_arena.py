"""Model weights in a reserved virtual range: their memory can go and come back at the same addresses.

A captured CUDA graph holds the addresses of the weights it reads. Tensors from torch's caching
allocator can only give their memory back by being freed, which would leave every graph reading
freed memory; tensors placed here keep their addresses while the physical memory behind them is
decommitted (the engine sleeps) and committed again (it wakes), so the graphs stay valid without
being captured again. `offload(keep=True)` first copies the bytes to host memory (page-locked on a
GPU, exactly their size: `memory/pinned.py`, so the copy back runs at full bandwidth) and `restore`
copies them back; with `keep=False` they are dropped and the loader fills the same tensors again
from the model files.

This module owns the range and the bytes; it never knows which tensor is which (the loader places
parameters at offsets through `tensor`).
"""

from __future__ import annotations

import logging

import torch

from snugkv.memory.arena import DEFAULT_CHUNK_BYTES, KvArena
from snugkv.memory.layout import BufferLayout
from snugkv.memory.pinned import HostBytes
from snugkv.memory.vmm import GIB, VirtualMemory

logger = logging.getLogger(__name__)

ALIGN_BYTES = 512  # what torch's caching allocator gives every tensor: vectorised kernels expect it
_NAME = "weights"


def aligned(size_bytes: int) -> int:
    return -(-size_bytes // ALIGN_BYTES) * ALIGN_BYTES


class WeightArena:
    """`size_bytes` of weights, committed at construction, viewed as typed tensors at offsets."""

    def __init__(self, vmm: VirtualMemory, size_bytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if size_bytes <= 0:
            raise ValueError(f"a weight arena needs a positive size, got {size_bytes} bytes")
        self.size_bytes = size_bytes
        self._arena = KvArena(vmm, size_bytes, label=_NAME, chunk_bytes=chunk_bytes)
        # A byte buffer is a layout of one-byte slots: N "tokens" plus the one-slot dummy page.
        layout = BufferLayout(_NAME, torch.uint8, (), page_size=1)
        self._buffer = self._arena.add_buffer(layout, size_bytes - 1)
        self._arena.commit({_NAME: size_bytes})
        self._bytes: torch.Tensor | None = self._arena.view(self._buffer)
        self._host: HostBytes | None = None
        self.resident = True

    @property
    def device(self) -> torch.device:
        return self._arena.device

    @property
    def committed_bytes(self) -> int:
        return self._arena.committed_bytes

    @property
    def reserved_bytes(self) -> int:
        return self._arena.reserved_bytes

    @property
    def holds_host_copy(self) -> bool:
        return self._host is not None

    def _view(self) -> torch.Tensor:
        if self._bytes is None:
            raise RuntimeError("the weight arena is closed")
        return self._bytes

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of `dtype` and `shape` at byte `offset` (a multiple of ALIGN_BYTES)."""
        if offset % ALIGN_BYTES:
            raise ValueError(f"weight offsets must be multiples of {ALIGN_BYTES} bytes, got {offset}")
        count = 1
        for dim in shape:
            count *= dim
        size = count * torch.empty((), dtype=dtype).element_size()
        if offset + size > self.size_bytes:
            raise ValueError(
                f"a weight of {size} bytes at {offset} passes the arena's end ({self.size_bytes})"
            )
        return self._view()[offset : offset + size].view(dtype).view(shape)

    def offload(self, keep: bool) -> int:
        """Decommit the weights (keeping a host copy when `keep`); returns the device bytes released."""
        if not self.resident:
            return 0
        if keep:
            self._host = HostBytes(
                self.size_bytes,
                pin=self.device.type == "cuda",
                required=False,
                touch=False,
                what="the weights' host copy",
            )
            self._host.tensor.copy_(self._view())
        released = self.committed_bytes
        self._arena.commit({_NAME: 0})  # synchronises first: the copy above has landed
        self.resident = False
        logger.info("weights released: %.2f GiB%s", released / GIB, " (copied to host)" if keep else "")
        return released

    def restore(self) -> bool:
        """Commit the weights again at the same addresses; copy the host copy back if there is one.
        Returns whether the contents are back (False: the caller must load them again)."""
        if self.resident:
            return True
        self._arena.commit({_NAME: self.size_bytes})
        self.resident = True
        if self._host is None:
            return False
        self._view().copy_(self._host.tensor, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._drop_host_copy()
        return True

    def _drop_host_copy(self) -> None:
        if self._host is not None:
            self._host.close()
        self._host = None

    def close(self) -> None:
        """Release the range; every tensor from `tensor` must be gone (the arena refuses otherwise)."""
        self._bytes = None
        self._drop_host_copy()
        self._arena.close()
