"""The KV arena: one reserved virtual range, named buffers inside it, commit watermarks.

The arena owns the address range and the physical extensions behind it. It never decides how
much to commit: pools ask for a byte count per buffer, sizing decides the token count. Buffers
sit at granularity-aligned offsets; each buffer is backed from its start up to a watermark.
Tensors handed out are zero-copy views that keep the arena alive; `close()` refuses while any
view lives, so the range is never unmapped under a tensor.

Chunks. A driver mapping can only be unmapped whole (`cuMemUnmap`), so a buffer is backed by
extensions of at most `chunk_bytes`, cut at chunk multiples from the buffer's start. Growing adds
chunks; shrinking drops whole extensions from the top, and the one that straddles the new end is
replaced by a smaller one holding exactly the kept bytes: a new extension is committed in a scratch
range, the kept bytes are copied there, the old one is decommitted and the new one is remapped to
its place. Contents below the new end are never lost, and what stays committed is the target
rounded up to one granule. The chunk size is a trade-off: every extension costs a driver handle
(on the H200, one 64 GiB handle maps in 2.3 ms, 64 handles of 1 GiB in 8.6 ms, so about 0.1 ms a
handle), while a shrink copies up to one chunk per buffer and needs one chunk free for a moment.
The default, 256 MiB, keeps a 100 GiB pool of 64 buffers at about 450 handles (tens of ms to map)
and a shrink's copy under 16 GiB at worst.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from snugkv.memory.layout import BufferLayout
from snugkv.memory.views import byte_view, typed_view
from snugkv.memory.vmm import GIB, KIB, MIB, CommitError, Extension, VirtualMemory

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 256 * MIB


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
        return sum(extension.size_bytes for extension in self.extensions)


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
        self._scratch_address: int | None = None  # reserved on the first shrink that keeps a part
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

        Growing adds extensions of at most `chunk_bytes`; shrinking drops extensions from the top
        and keeps every byte below the new end (see the module docstring). Growth is all or
        nothing: if any commit fails, every extension made by this call is released and the
        `CommitError` propagates. Returns the bytes newly committed.
        """
        self._check_open()
        plans = [
            (self._buffers[name], self._target_bytes(self._buffers[name], size))
            for name, size in targets.items()
        ]
        self._synchronize()
        for buffer, target in plans:
            if target < buffer.committed_bytes:
                self._drop_above(buffer, target)
        unsplit: list[tuple[str, int, str]] = []  # buffers left with their whole top extension
        for buffer, target in plans:
            if target < buffer.committed_bytes:
                reason = self._split_top(buffer, target)
                if reason is not None:
                    unsplit.append((buffer.name, buffer.committed_bytes - target, reason))
        if unsplit:
            logger.warning(
                "%s arena: %d buffer(s) keep %.1f MiB more than asked (%s, ...): no room to split their top "
                "extension (%s); a later shrink or a smaller --kv-chunk-mib gives it back",
                self.label,
                len(unsplit),
                sum(extra for _, extra, _ in unsplit) / MIB,
                unsplit[0][0],
                unsplit[0][2],
            )
        added: list[tuple[ArenaBuffer, Extension]] = []
        try:
            for buffer, target in plans:
                for start, size in self._pieces(buffer.committed_bytes, target):
                    extension = self.vmm.commit(self.base_address + buffer.offset + start, size)
                    buffer.extensions.append(extension)
                    added.append((buffer, extension))
        except BaseException:  # CommitError, or any other failure of the backend: all or nothing
            for buffer, extension in reversed(added):
                buffer.extensions.remove(extension)
                self.vmm.decommit(extension)
            raise
        return sum(extension.size_bytes for _, extension in added)

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

    def _drop_above(self, buffer: ArenaBuffer, target: int) -> None:
        """Decommit the extensions that lie wholly at or above `target` bytes into the buffer."""
        end = self.base_address + buffer.offset + target
        while buffer.extensions and buffer.extensions[-1].address >= end:
            self.vmm.decommit(buffer.extensions.pop())

    def _split_top(self, buffer: ArenaBuffer, target: int) -> str | None:
        """Replace the top extension, which straddles `target`, by one holding only its bytes below
        `target`, contents kept. Without memory for the moment both exist, the whole extension
        stays (at most one chunk more than asked stays committed): returns why, else None."""
        top = buffer.extensions[-1]
        kept = self.base_address + buffer.offset + target - top.address
        if kept > self.chunk_bytes:  # never made by this arena; nothing to split it through
            return "an extension larger than a chunk"
        scratch = self._scratch()
        try:
            fresh = self.vmm.commit(scratch, kept)
        except CommitError as exc:
            return str(exc)
        try:
            self._copy(scratch, top.address, kept)
            self._synchronize()
        except BaseException:
            self.vmm.decommit(fresh)
            raise
        self.vmm.decommit(buffer.extensions.pop())
        buffer.extensions.append(self.vmm.remap(fresh, top.address))
        return None

    def _scratch(self) -> int:
        if self._scratch_address is None:
            self._scratch_address = self.vmm.reserve(self.chunk_bytes)
        return self._scratch_address

    def _copy(self, destination: int, source: int, size_bytes: int) -> None:
        """Copy `size_bytes` between two committed addresses of this arena's device."""
        views = [
            byte_view(address, size_bytes, self.device, owner=self, on_release=_nothing)
            for address in (destination, source)
        ]
        views[0].copy_(views[1])

    def _synchronize(self) -> None:
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
        self._synchronize()
        for buffer in reversed(list(self._buffers.values())):
            while buffer.extensions:
                self.vmm.decommit(buffer.extensions.pop())
        self.vmm.release(self.base_address, self.reserved_bytes)
        if self._scratch_address is not None:
            self.vmm.release(self._scratch_address, self.chunk_bytes)
        self._closed = True

    def __del__(self) -> None:
        # Only reachable when no view holds the arena; a failure here must not raise at exit.
        try:
            if not self._closed and not self._live_views:
                self.close()
        except Exception:
            pass


def _nothing() -> None:
    """A transient view's release callback: copies inside the arena are not counted as live views."""
