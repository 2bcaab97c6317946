"""The KV arena: one reserved virtual range, named buffers inside it, commit watermarks.

The arena owns the address range and the physical extensions behind it. It never decides how
much to commit: pools ask for a byte count per buffer, sizing decides the token count. Buffers
sit at granularity-aligned offsets; each buffer is backed from its start up to a watermark.
Tensors handed out are zero-copy views that keep the arena alive; `close()` refuses while any
view lives, so the range is never unmapped under a tensor.

Chunks. A driver mapping can only be unmapped whole (`cuMemUnmap`), and its physical memory goes
back only with it, so a buffer is backed by extensions of at most `chunk_bytes`, cut at chunk
multiples from the buffer's start. Growing adds extensions; shrinking drops the extensions that lie
wholly above the new end and keeps the one the end falls in, whole. A shrink therefore never asks
the device for memory (no extension is split: splitting needs new physical memory for a moment,
which is exactly what a device under pressure lacks) and keeps at most one chunk per buffer more
than asked. `auto_chunk_bytes` picks the chunk so that this excess stays under `SHRINK_EXCESS_BYTES`
over all buffers of the arena, and under 1/32 of the arena where that is less (a CPU's small cache); `backing_bytes` answers what a commit to a target would leave
committed, so sizing counts exactly the memory a resize takes or gives back. Every extension costs a
driver handle (on the H200, ~45 us to create and map one of 2 MiB; docs/bench/pressure.md measures
the arena's start-up commit and a 10 GiB shrink).
"""

from __future__ import annotations

import bisect
import logging
import threading
from dataclasses import dataclass, field

import torch

from snugkv.memory.layout import BufferLayout
from snugkv.memory.views import byte_view, typed_view
from snugkv.memory.vmm import GIB, KIB, MIB, Extension, VirtualMemory

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 256 * MIB  # the weights' arena (released whole, never shrunk part-way)
SHRINK_EXCESS_BYTES = 512 * MIB  # what a shrink may keep beyond its target, over all of an arena's buffers


def auto_chunk_bytes(num_buffers: int, granularity_bytes: int, arena_bytes: int | None = None) -> int:
    """The largest chunk (a granule multiple) that keeps a shrink's excess, one chunk per buffer at
    most, under `SHRINK_EXCESS_BYTES` and 1/32 of `arena_bytes`; one granule where even that is
    more (hundreds of buffers, a tiny arena)."""
    excess = SHRINK_EXCESS_BYTES if arena_bytes is None else min(SHRINK_EXCESS_BYTES, arena_bytes // 32)
    per_buffer = excess // max(num_buffers, 1)
    return max(granularity_bytes, per_buffer // granularity_bytes * granularity_bytes)


class ArenaClosedError(RuntimeError):
    """The arena was closed; its buffers can no longer be used."""


@dataclass(slots=True)
class ArenaBuffer:
    """One buffer placed in the arena: `reserved_bytes` of address space at `offset`."""

    layout: BufferLayout
    reserved_tokens: int
    offset: int
    reserved_bytes: int
    extensions: list[Extension] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def committed_bytes(self) -> int:
        """The extensions follow one another from the buffer's start (a grow adds at the end, a
        shrink drops from the end), so the last one's end is the count: O(1), not a sum over
        thousands of extensions (sizing asks it in a bisection on every memory check)."""
        if not self.extensions:
            return 0
        last = self.extensions[-1]
        return last.address + last.size_bytes - self.extensions[0].address


def _end_address(extension: Extension) -> int:
    return extension.address + extension.size_bytes


class KvArena:
    """A reserved virtual range holding KV buffers, backed on demand through `vmm`."""

    def __init__(
        self,
        vmm: VirtualMemory,
        reserved_bytes: int,
        label: str = "kv",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if reserved_bytes <= 0:
            raise ValueError(f"reserved_bytes must be positive, got {reserved_bytes}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.vmm = vmm
        self.label = label
        self.reserved_bytes = vmm.align_up(reserved_bytes)
        self.chunk_bytes = vmm.align_up(chunk_bytes)
        self.base_address = vmm.reserve(self.reserved_bytes)
        self._buffers: dict[str, ArenaBuffer] = {}
        self._cursor_bytes = 0
        self._live_views = 0
        self._views_lock = threading.Lock()
        self._closed = False
        logger.info(
            "%s arena: reserved_va=%.2f GiB granularity=%d KiB device=%s (virtual, not physical)",
            label,
            self.reserved_bytes / GIB,
            vmm.granularity_bytes // KIB,
            vmm.device,
        )

    @property
    def device(self) -> torch.device:
        return self.vmm.device

    @property
    def buffers(self) -> list[ArenaBuffer]:
        return list(self._buffers.values())

    @property
    def committed_bytes(self) -> int:
        return sum(buffer.committed_bytes for buffer in self._buffers.values())

    def _check_open(self) -> None:
        if self._closed:
            raise ArenaClosedError(f"{self.label} arena is closed")

    def add_buffer(self, layout: BufferLayout, reserved_tokens: int) -> ArenaBuffer:
        """Place a buffer big enough for `reserved_tokens` usable tokens; nothing is backed."""
        self._check_open()
        if layout.name in self._buffers:
            raise ValueError(f"{self.label} arena already has a buffer named {layout.name!r}")
        size_bytes = self.vmm.align_up(layout.bytes_for_tokens(reserved_tokens))
        if self._cursor_bytes + size_bytes > self.reserved_bytes:
            raise ValueError(
                f"{self.label} arena: buffer {layout.name!r} needs {size_bytes / GIB:.3f} GiB but only "
                f"{(self.reserved_bytes - self._cursor_bytes) / GIB:.3f} GiB of the reserved range is left; "
                "reserve a larger range or ask for fewer tokens"
            )
        buffer = ArenaBuffer(layout, reserved_tokens, self._cursor_bytes, size_bytes)
        self._buffers[layout.name] = buffer
        self._cursor_bytes += size_bytes
        return buffer

    def view(self, buffer: ArenaBuffer) -> torch.Tensor:
        """The buffer as a tensor of its upper-bound shape; only committed bytes may be touched."""
        self._check_open()
        with self._views_lock:
            self._live_views += 1
        raw = byte_view(
            self.base_address + buffer.offset,
            buffer.reserved_bytes,
            self.device,
            owner=self,
            on_release=self._view_released,
        )
        layout = buffer.layout
        shape = layout.shape_for_tokens(buffer.reserved_tokens)
        return typed_view(raw[: layout.bytes_for_tokens(buffer.reserved_tokens)], layout.dtype, shape)

    def _view_released(self) -> None:
        with self._views_lock:
            self._live_views -= 1

    def commit(self, targets: dict[str, int]) -> int:
        """Back each named buffer up to its target byte count (rounded up to a granule).

        Growing adds extensions of at most `chunk_bytes`; shrinking decommits the extensions wholly
        above the target and keeps the one it falls in (see the module docstring): it never asks the
        backend for memory and keeps every byte below the target. Growth is all or nothing: if any
        commit fails, every extension made by this call is released and the `CommitError`
        propagates. Returns the bytes newly committed.
        """
        self._check_open()
        plans = [
            (self._buffers[name], self._target_bytes(self._buffers[name], size))
            for name, size in targets.items()
        ]
        if any(target < buffer.committed_bytes for buffer, target in plans):
            self.synchronize()  # no queued kernel may touch what is unmapped
        dropped = [extension for buffer, target in plans for extension in self._drop_above(buffer, target)]
        if dropped:  # one batch for every buffer: the backend may merge the driver calls
            self.vmm.decommit_many(dropped)
        added: list[tuple[ArenaBuffer, Extension]] = []
        try:
            for buffer, target in plans:
                pieces = self._pieces(buffer.committed_bytes, target)
                if not pieces:
                    continue
                start = self.base_address + buffer.offset + pieces[0][0]
                for extension in self.vmm.commit_pieces(start, [size for _, size in pieces]):
                    buffer.extensions.append(extension)
                    added.append((buffer, extension))
        except BaseException:  # CommitError, or any other failure of the backend: all or nothing
            for buffer, extension in reversed(added):
                buffer.extensions.remove(extension)
                self.vmm.decommit(extension)
            raise
        return sum(extension.size_bytes for _, extension in added)

    def backing_bytes(self, name: str, size_bytes: int) -> int:
        """What buffer `name` would hold committed after `commit({name: size_bytes})`: the target
        rounded up to a granule when it grows, the end of the extension it falls in when it shrinks."""
        buffer = self._buffers[name]
        target = self._target_bytes(buffer, size_bytes)
        committed = buffer.committed_bytes
        if target >= committed:
            return target
        if target == 0:
            return 0
        start = self.base_address + buffer.offset
        index = bisect.bisect_left(buffer.extensions, start + target, key=_end_address)
        return _end_address(buffer.extensions[index]) - start

    def _pieces(self, start: int, end: int) -> list[tuple[int, int]]:
        """`[start, end)` of a buffer cut at multiples of `chunk_bytes`: (offset, size) pairs."""
        pieces = []
        while start < end:
            stop = min(end, (start // self.chunk_bytes + 1) * self.chunk_bytes)
            pieces.append((start, stop - start))
            start = stop
        return pieces

    def _target_bytes(self, buffer: ArenaBuffer, size_bytes: int) -> int:
        if size_bytes < 0:
            raise ValueError(f"{buffer.name}: cannot back a negative byte count ({size_bytes})")
        if size_bytes > buffer.reserved_bytes:
            raise ValueError(
                f"{buffer.name}: {size_bytes} bytes exceed the {buffer.reserved_bytes} reserved for it "
                f"(upper bound {buffer.reserved_tokens} tokens)"
            )
        return self.vmm.align_up(size_bytes)

    def _drop_above(self, buffer: ArenaBuffer, target: int) -> list[Extension]:
        """Take off the buffer the extensions that lie wholly at or above `target` bytes into it,
        in address order, for the caller to decommit."""
        end = self.base_address + buffer.offset + target
        dropped: list[Extension] = []
        while buffer.extensions and buffer.extensions[-1].address >= end:
            dropped.append(buffer.extensions.pop())
        return dropped[::-1]

    def synchronize(self) -> None:
        """Wait for the work queued on the device (a decommit may not unmap what it reads)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Decommit every extension and release the range; idempotent.

        Refuses while views are alive: drop every tensor from `view()` (and the pools holding
        them) first.
        """
        if self._closed:
            return
        if self._live_views:
            raise RuntimeError(
                f"{self.label} arena still has {self._live_views} live tensor view(s); "
                "release the KV pools and their tensors before closing it"
            )
        self.synchronize()
        dropped = [
            extension for buffer in self._buffers.values() for extension in self._drop_above(buffer, 0)
        ]
        self.vmm.decommit_many(dropped)
        self.vmm.release(self.base_address, self.reserved_bytes)
        self._closed = True

    def __del__(self) -> None:
        # Only reachable when no view holds the arena; a failure here must not raise at exit.
        try:
            if not self._closed and not self._live_views:
                self.close()
        except Exception:
            pass
