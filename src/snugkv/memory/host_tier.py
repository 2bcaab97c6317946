"""The KV cache's second tier: pages of the prefix cache kept in (pinned) host memory.

A device page is `page_size` slots of every KV buffer of a pool; a host page holds the same bytes
of every buffer (row 0 unused, as the device's dummy page). The prefix cache moves whole pages
between the two: a device eviction writes them here (`write`), a hit on them loads them back
(`load`).

This module owns the host pages (which are free: the one host allocator, lowest pages first) and
when copies run; it never decides what moves (the prefix cache does) and never frees a device slot.
How copies are issued, and so how the host pages are laid out, is the copy path's
(snugkv.memory.tier_copies): with a staging buffer (the engine's default) in chunks through it,
page-major on the host; without one, one `copy_` per run of pages per buffer (for comparison).

Copies run through a `PageCopies`:
- on a GPU (`StreamCopies`) on one copy stream of their own. A load first waits for the work
  already queued on the compute stream (a slot it fills may still be written by the step in
  flight, for a request that ended in that step), and the compute stream then waits for the load:
  the next forward reads the loaded KV, the host never waits. A write waits for nothing on the
  compute stream: a page the prefix cache holds is never written by a launched step (its KV came
  from steps whose tokens were read), except by a shrink's page moves, after which
  `order_after_compute` is called. Every copy returns a `CopyDone`; a device page that was written
  out goes back to the allocator only after its `wait()`. All copies share the one stream, so a
  host page, and the staging buffer, reused by a later copy is reused in order.
- on CPU (`HostCopies`) at once: the same code path, with a 'device' that is host memory too.
Tests pass a copier of their own to hold copies back and check that nothing reads or reuses a page
before its copy is done.

How fast pages reach the host (`probe_write_bytes_per_s`, run once at start-up through the same
copies) is what turns a pressure move's time budget into pages it may spill (`spill_tokens_within`).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from snugkv.memory.allocator import make_allocator
from snugkv.memory.pinned import HostBytes
from snugkv.memory.tier_copies import PerRunCopies, StagedCopies, TierCopyPath

logger = logging.getLogger(__name__)

PROBE_BYTES = 64 * 2**20  # the start-up bandwidth probe's copy: long enough that launches do not dominate
PROBE_REPEATS = 3


class CopyDone(ABC):
    """A copy on its way; `wait()` returns once it is done (at once if it is)."""

    @abstractmethod
    def wait(self) -> None: ...

    def before_device_reuse(self) -> None:
        """The device pages this copy reads or fills may be handed out again now: whatever the
        device does with them later runs after the copy. A GPU orders its compute stream after the
        copy, with no host wait (a host wait here would also wait for the step in flight whenever a
        load, which follows that step, is queued ahead on the copy stream); by default, a wait."""
        self.wait()


class _Done(CopyDone):
    def wait(self) -> None:
        return None


COPIED: CopyDone = _Done()


class PageCopies(ABC):
    """Where and when page copies run."""

    @abstractmethod
    def run(self, copy: Callable[[], None], *, load: bool) -> CopyDone:
        """Run `copy` (a series of `copy_` calls). Neither a load nor a write waits for the device's
        queued work: the pages a load fills are free, which no queued work uses (the scheduler holds
        back the slots of requests in an unread step: `RequestSlots.release`), and the pages a write
        reads hold finished KV; both wait for what `order_after_compute` marked. The device's later
        work waits for a load."""

    @abstractmethod
    def order_after_compute(self) -> None:
        """The next copies run after the work queued for the device now (pages were moved there)."""

    @abstractmethod
    def elapsed_s(self) -> tuple[float, float]:
        """Seconds the writes and the loads done by now took (on a GPU: on the copy stream)."""


class HostCopies(PageCopies):
    """CPU: every copy runs now, in the caller's thread."""

    def __init__(self) -> None:
        self._elapsed_s = [0.0, 0.0]  # writes, loads

    def run(self, copy: Callable[[], None], *, load: bool) -> CopyDone:
        started = time.perf_counter()
        copy()
        self._elapsed_s[load] += time.perf_counter() - started
        return COPIED

    def order_after_compute(self) -> None:
        return None  # every copy ran in order already

    def elapsed_s(self) -> tuple[float, float]:
        return self._elapsed_s[0], self._elapsed_s[1]


class _EventDone(CopyDone):
    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self.event = event
        self.device = device

    def wait(self) -> None:
        self.event.synchronize()

    def before_device_reuse(self) -> None:
        # Every later use of device pages is compute-stream work, or a copy on the copy stream
        # (which follows this one): ordering the compute stream is enough.
        torch.cuda.current_stream(self.device).wait_event(self.event)


class StreamCopies(PageCopies):
    """GPU: copies on one stream of their own, ordered against the compute stream by events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._timed: list[tuple[bool, torch.cuda.Event, torch.cuda.Event]] = []
        self._elapsed_s = [0.0, 0.0]  # writes, loads
        self._after: torch.cuda.Event | None = None

    def run(self, copy: Callable[[], None], *, load: bool) -> CopyDone:
        compute = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if self._after is not None:  # pages were moved on the compute stream: after the move
            self.stream.wait_event(self._after)
            self._after = None
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            copy()
            end.record(self.stream)
        if load:
            compute.wait_event(end)
        self._timed.append((load, start, end))
        if len(self._timed) > 1024:  # nobody read the times lately: fold the finished ones in
            self.elapsed_s()
        return _EventDone(end, self.device)

    def order_after_compute(self) -> None:
        self._after = torch.cuda.Event()
        self._after.record(torch.cuda.current_stream(self.device))

    def elapsed_s(self) -> tuple[float, float]:
        """Adds up the copies done by now (a query, never a wait)."""
        pending = []
        for load, start, end in self._timed:
            if end.query():
                self._elapsed_s[load] += start.elapsed_time(end) / 1000
            else:
                pending.append((load, start, end))
        self._timed = pending
        return self._elapsed_s[0], self._elapsed_s[1]


@dataclass(frozen=True, slots=True)
class TierTraffic:
    """What moved between the tiers since start-up."""

    bytes_to_host: int
    bytes_to_device: int
    pages_to_host: int
    pages_to_device: int
    write_s: float  # device -> host: time of the copies done by now (a GPU's: on its copy stream)
    load_s: float  # host -> device, likewise


class HostKvTier:
    """Host pages for a pool's device pages: `alloc`/`free` them, `write` device pages into them,
    `load` them into device pages. `device_pages` are the pool's buffers seen as
    `[pool pages, page bytes]` uint8 rows (`KVPool.page_views`). `staging`: a uint8 buffer on the
    pool's device, allocated once before the KV cache was sized, that copies go through in chunks
    (`StagedCopies`); None: one copy per run of pages per buffer (`PerRunCopies`)."""

    def __init__(
        self,
        device_pages: list[torch.Tensor],
        *,
        num_pages: int,
        page_size: int,
        copies: PageCopies,
        pin_memory: bool,
        staging: torch.Tensor | None = None,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"a host KV tier needs at least one page, got {num_pages}")
        self.page_size = page_size
        self.copies = copies
        rows = [view.shape[1] for view in device_pages]
        self.page_bytes = sum(rows)  # one page of every buffer
        size_bytes = (num_pages + 1) * self.page_bytes
        self._host = HostBytes(size_bytes, pin=pin_memory, what="the host KV tier")
        flat = self._host.tensor
        self.path: TierCopyPath = (
            PerRunCopies(device_pages, flat, num_pages)
            if staging is None
            else StagedCopies(device_pages, flat, num_pages, staging)
        )
        self.pinned = pin_memory
        self._free = make_allocator(num_pages, 1)  # host page p is "slot" p; page 0 is never handed out
        self._bytes = [0, 0]  # to host, to device
        self._pages = [0, 0]
        # device -> host bytes per second, as measured at start-up (the same on every rank: the
        # opener sets the MIN over ranks); None: not measured, a spill has no time budget then
        self.write_bytes_per_s: float | None = None

    @property
    def staging_bytes(self) -> int:
        """The device staging the copies go through (0: per run, none)."""
        return self.path.staging_bytes

    @property
    def copy_path_text(self) -> str:
        """How copies are issued, for the start-up log line."""
        return self.path.describe()

    # -- the host pages ---------------------------------------------------------------------
    @property
    def capacity_pages(self) -> int:
        return self._free.capacity_tokens

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_pages * self.page_size

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_pages * self.page_bytes

    @property
    def free_pages(self) -> int:
        return self._free.available_tokens

    @property
    def used_pages(self) -> int:
        return self.capacity_pages - self.free_pages

    def alloc(self, num_pages: int) -> torch.Tensor | None:
        """`num_pages` free host pages (int64, lowest first), or None when fewer are free."""
        return self._free.alloc(num_pages)

    def free(self, pages: torch.Tensor) -> None:
        """Give host pages back. A copy still on its way into or out of them is ordered before any
        later copy that reuses them (one copy stream), so no wait is needed."""
        self._free.free(pages)

    def check_integrity(self) -> None:
        self._free.check_integrity()

    # -- copies -----------------------------------------------------------------------------
    def write(self, device_pages: torch.Tensor, host_pages: torch.Tensor) -> CopyDone:
        """Copy device pages into host pages (same order); the device pages must not be reused
        before the returned `wait()`."""
        copy = self.path.write(device_pages, host_pages)
        self._count(0, int(device_pages.numel()))
        return self.copies.run(copy, load=False)

    def load(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> CopyDone:
        """Copy host pages into device pages (same order); the device's later work reads them after
        the copy, and the host pages must stay as they are until it is done (they do: see `free`)."""
        copy = self.path.load(host_pages, device_pages)
        self._count(1, int(device_pages.numel()))
        return self.copies.run(copy, load=True)

    def probe_write_bytes_per_s(self, device_pages: int, max_bytes: int = PROBE_BYTES) -> float | None:
        """Time writes of up to `max_bytes` of device pages 1.. (the first `device_pages` hold
        committed memory; what they hold does not matter) into free host pages, as a spill writes
        them, waiting for each: the best of `PROBE_REPEATS`, in bytes per second (the host's view, launches
        included). Counted in `traffic` like any write. None when there is nothing to copy."""
        pages = min(device_pages, self.free_pages, max(1, max_bytes // self.page_bytes))
        host_pages = self.alloc(pages) if pages > 0 else None
        if host_pages is None:
            return None
        try:
            source = torch.arange(1, pages + 1, dtype=torch.int64)
            best_s = float("inf")
            for _ in range(PROBE_REPEATS):  # the first one also warms the copy path up
                started = time.perf_counter()
                self.write(source, host_pages).wait()
                best_s = min(best_s, time.perf_counter() - started)
        finally:
            self.free(host_pages)
        return pages * self.page_bytes / max(best_s, 1e-9)

    def spill_tokens_within(self, seconds: float) -> int | None:
        """How many tokens (whole pages) `seconds` of writes carry at the measured bandwidth; None
        when it was not measured (no budget)."""
        if self.write_bytes_per_s is None:
            return None
        pages = int(max(seconds, 0.0) * self.write_bytes_per_s // self.page_bytes)
        return pages * self.page_size

    def order_after_compute(self) -> None:
        """Pages were moved on the device (a shrink): later copies run after that move."""
        self.copies.order_after_compute()

    def _count(self, direction: int, pages: int) -> None:
        self._pages[direction] += pages
        self._bytes[direction] += pages * self.page_bytes

    def traffic(self) -> TierTraffic:
        write_s, load_s = self.copies.elapsed_s()
        return TierTraffic(self._bytes[0], self._bytes[1], self._pages[0], self._pages[1], write_s, load_s)

    def close(self) -> None:
        """Drop the host memory, the staging and the views of the pool's buffers (before the pool's
        arena goes)."""
        self.path = PerRunCopies([], torch.empty(0, dtype=torch.uint8), 0)
        if self._host.pinned:
            torch.cuda.synchronize()  # no copy in flight reads or writes what is unregistered
        self._host.close()
