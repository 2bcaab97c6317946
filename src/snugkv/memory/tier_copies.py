"""How the host tier's page copies are issued, and how its host pages are laid out for them.

A page is `page_size` slots of every KV buffer of a pool (one buffer per layer for MHA's fused K/V
and for MLA), so moving N pages touches N rows of every buffer. Two ways to issue that:

- `PerRunCopies` (the first one built; kept for comparison): host memory buffer-major, one
  `[pages + 1, row bytes]` block per device buffer, and one `copy_` per run of pages consecutive on
  both sides per buffer. A fragmented prefix of the Llama-3-8B shape (250 runs x 32 buffers) is
  ~8,000 copies of 64 KiB: launch-bound, a few GB/s.
- `StagedCopies` (the default): host memory page-major, `[pages + 1, page bytes]` (a host page
  holds its rows of every buffer side by side), and copies in chunks through a fixed staging
  buffer on the device, allocated once at start-up (`STAGING_BYTES`: a line of the memory ledger,
  counted before the KV cache is sized; nothing is allocated on the device while serving, so a
  spill under memory pressure asks for no device memory). Per chunk of at most
  `chunk_pages` pages: the chunk's device page numbers into the staging's index area (a few bytes),
  then
    load:  one host -> device copy per run of consecutive host pages (the host allocates lowest
           first: usually one) into the staging, then the rows scattered into every buffer;
    write: the rows gathered from every buffer into the staging, then one device -> host copy per
           host run.
  The gathers and scatters take one launch for all buffers on a GPU (memory/page_copy.py; a launch
  per buffer, `index_select` / `index_copy_`, where the buffers' rows differ or on CPU).
  The 8B example becomes 17 chunks of at most 15 pages (2 MiB each; two lanes on a GPU, below):
  17 large copies, 17 index uploads and 17 gathers or scatters on the device (17 x 32 with a
  launch per buffer; rows moved as 8-byte words where the rows allow), instead of ~8,000 copies. Why a staging and not a zero-copy kernel: docs/HOST_TIER.md.

Both run everything through the closures they return, which a `PageCopies` runs (on a GPU on its
one copy stream). On a GPU the staging is split into two lanes that consecutive chunks take in
turn, and the gathers and scatters run on a second stream, ordered against the copy stream by
per-lane events (a lane is reused only after its last reader ended; a closure joins the second
stream at its start and its end, so the next copy follows it with no host wait): one chunk's
scatter runs while the next chunk's host copy does (the H100 run at be28b89 loaded at 41.2 GB/s
in serving and 45.0 in the micro-bench, against 55.3 for a plain pinned copy, with each chunk's
32 scatters after its copy). On CPU the same code runs with host memory as the
'device', so CPU tests cover the batched indexing. This module never decides what moves nor
when (snugkv.memory.host_tier and the prefix cache do).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from snugkv.memory.page_copy import buffer_table, gather_pages, scatter_pages, uniform_rows
from snugkv.memory.views import WORD_DTYPES, words_fit
from snugkv.memory.vmm import MIB

logger = logging.getLogger(__name__)

STAGING_BYTES = 64 * MIB  # the device staging of the batched path: a chunk's pages and their index
INDEX_ALIGN_BYTES = 256  # where the staging's index area starts (after the chunk's pages)
WORD_BYTES = (8, 4, 2, 1)  # rows move as the widest word that every row and offset divides

Copy = Callable[[], None]


class TierCopyPath(ABC):
    """The host pages' layout over one host allocation, and the copies between them and the pool's
    device pages (`[pool pages, row bytes]` uint8 views, one per buffer)."""

    name: str
    issued: int  # copies and kernels issued so far (index uploads included)
    staging_bytes: int = 0  # the device staging held (0: none)

    @abstractmethod
    def describe(self) -> str:
        """One phrase for the start-up log line."""

    @abstractmethod
    def write(self, device_pages: torch.Tensor, host_pages: torch.Tensor) -> Copy:
        """The copies of device pages into host pages (same order), to run later."""

    @abstractmethod
    def load(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> Copy:
        """The copies of host pages into device pages (same order), to run later."""


class PerRunCopies(TierCopyPath):
    """One `copy_` per run of pages consecutive in both lists, per buffer; host memory buffer-major."""

    name = "per-run"

    def __init__(self, device_views: list[torch.Tensor], host_flat: torch.Tensor, num_pages: int) -> None:
        self._device = device_views
        self._host: list[torch.Tensor] = []
        offset = 0
        for view in device_views:
            size = (num_pages + 1) * view.shape[1]
            self._host.append(host_flat[offset : offset + size].view(num_pages + 1, view.shape[1]))
            offset += size
        self.issued = 0

    def describe(self) -> str:
        return "one copy per run of pages per buffer"

    def write(self, device_pages: torch.Tensor, host_pages: torch.Tensor) -> Copy:
        runs = page_runs(device_pages, host_pages)
        self.issued += len(runs) * len(self._device)

        def copy() -> None:
            for device, host in zip(self._device, self._host):
                for first_device, first_host, count in runs:
                    host[first_host : first_host + count].copy_(
                        device[first_device : first_device + count], non_blocking=True
                    )

        return copy

    def load(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> Copy:
        runs = page_runs(device_pages, host_pages)
        self.issued += len(runs) * len(self._device)

        def copy() -> None:
            for device, host in zip(self._device, self._host):
                for first_device, first_host, count in runs:
                    device[first_device : first_device + count].copy_(
                        host[first_host : first_host + count], non_blocking=True
                    )

        return copy


class StagedCopies(TierCopyPath):
    """Chunks through a fixed staging buffer on the device; host memory page-major. `staging`: uint8
    on the pool's device, at least one page plus its index (else `ValueError`).

    `lanes` (default: 2 on a GPU, 1 on CPU): the staging is split into that many lanes, used in
    turn by consecutive chunks, so that on a GPU one chunk's gathers or scatters (on a stream of
    their own) run while the next chunk's host copy does (on the copy stream), each lane reused only
    after its last reader ended (events); with one lane every step of every chunk is in one order."""

    name = "batched"

    def __init__(
        self,
        device_views: list[torch.Tensor],
        host_flat: torch.Tensor,
        num_pages: int,
        staging: torch.Tensor,
        lanes: int | None = None,
        one_launch: bool | None = None,
    ) -> None:
        rows = [view.shape[1] for view in device_views]
        page_bytes = sum(rows)
        total = chunk_pages_of(staging.numel(), page_bytes)
        if total < 1:
            raise ValueError(
                f"a staging buffer of {staging.numel()} bytes holds no page of {page_bytes} bytes and its index"
            )
        self.lanes = max(1, min(lanes or (2 if staging.is_cuda else 1), total))
        self.chunk_pages = total // self.lanes
        self._host = host_flat.view(num_pages + 1, page_bytes)
        staged = staging[: total * page_bytes].view(total, page_bytes)
        index_at = _round_up(total * page_bytes, INDEX_ALIGN_BYTES)
        index = staging[index_at : index_at + 8 * total].view(torch.int64)
        pages = self.chunk_pages
        self._staged = [staged[lane * pages : (lane + 1) * pages] for lane in range(self.lanes)]
        self._index = [index[lane * pages : (lane + 1) * pages] for lane in range(self.lanes)]
        self._pin_index = staging.is_cuda  # the index's upload must not make the host wait
        offsets = [sum(rows[:b]) for b in range(len(rows))]
        word = next(
            size
            for size in WORD_BYTES
            if all(value % size == 0 for value in (page_bytes, *rows, *offsets))
            and all(words_fit(view, size) for view in device_views)
        )
        dtype = WORD_DTYPES[word]
        self.word_bytes = word
        # every buffer, and its columns of each lane's staged pages, as rows of words
        self._device = [view.view(dtype) for view in device_views]
        self._columns = [
            [lane_pages[:, offset : offset + row].view(dtype) for offset, row in zip(offsets, rows)]
            for lane_pages in self._staged
        ]
        # a GPU with two lanes or more: the device-side kernels run on a stream of their own
        self._kernels: torch.cuda.Stream | None = None
        if staging.is_cuda and self.lanes > 1:
            self._kernels = torch.cuda.Stream(staging.device)
            self._staged_ready = [torch.cuda.Event() for _ in range(self.lanes)]  # its pages are in
            self._lane_free = [torch.cuda.Event() for _ in range(self.lanes)]  # its last reader ended
        self.staging_bytes = int(staging.numel())
        self.issued = 0
        # every buffer's rows of a chunk in one launch (memory/page_copy.py), where the rows allow:
        # by default on a GPU (a launch per buffer per chunk is host time on the scheduler's thread)
        self._table: torch.Tensor | None = None
        if (staging.is_cuda if one_launch is None else one_launch) and uniform_rows(self._device):
            self._table = buffer_table(self._device)
            self._row_words = int(self._device[0].shape[1])
            self._staged_words = [lane_pages.view(dtype) for lane_pages in self._staged]
            try:  # built now, at start-up: page 0 (the pool's dummy page) there and back
                first = torch.zeros(1, dtype=torch.int64, device=staging.device)
                gather_pages(self._staged_words[0], first, self._table, self._row_words)
                scatter_pages(self._staged_words[0], first, self._table, self._row_words)
            except Exception as exc:  # a Triton that cannot build it: the launch per buffer
                logger.warning(
                    "Host KV tier: a launch per buffer per chunk (%s: %s)", type(exc).__name__, exc
                )
                self._table = None

    def describe(self) -> str:
        launches = "one launch for all buffers" if self._table is not None else "a launch per buffer"
        return (
            f"batched through {self.staging_bytes / MIB:.3g} MiB of device staging, "
            f"{self.lanes} lane(s) of {self.chunk_pages} pages, {launches} a chunk"
        )

    def write(self, device_pages: torch.Tensor, host_pages: torch.Tensor) -> Copy:
        chunks = self._chunks(device_pages, host_pages)

        def gather(lane: int, index: torch.Tensor) -> None:
            count = self._upload(index, lane)
            if self._table is not None:
                gather_pages(
                    self._staged_words[lane], self._index[lane][:count], self._table, self._row_words
                )
                return
            for device, column in zip(self._device, self._columns[lane]):
                torch.index_select(device, 0, self._index[lane][:count], out=column[:count])

        def to_host(lane: int, runs: list[tuple[int, int, int]]) -> None:
            staged = self._staged[lane]
            for first_host, at, pages in runs:
                self._host[first_host : first_host + pages].copy_(staged[at : at + pages], non_blocking=True)

        def copy() -> None:
            kernels = self._kernels
            if kernels is None:  # one order for everything
                for number, (index, runs) in enumerate(chunks):
                    gather(number % self.lanes, index)
                    to_host(number % self.lanes, runs)
                return
            copies = torch.cuda.current_stream(kernels.device)
            kernels.wait_stream(copies)  # after what the copy stream was told to follow
            for number, (index, runs) in enumerate(chunks):
                lane = number % self.lanes
                if number >= self.lanes:  # the host copies of this lane's last chunk read it
                    kernels.wait_event(self._lane_free[lane])
                with torch.cuda.stream(kernels):
                    gather(lane, index)
                self._staged_ready[lane].record(kernels)
                copies.wait_event(self._staged_ready[lane])
                to_host(lane, runs)
                self._lane_free[lane].record(copies)
            copies.wait_stream(kernels)  # the copy's end covers every kernel it launched

        return copy

    def load(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> Copy:
        chunks = self._chunks(device_pages, host_pages)

        def to_staging(lane: int, index: torch.Tensor, runs: list[tuple[int, int, int]]) -> int:
            count = self._upload(index, lane)
            staged = self._staged[lane]
            for first_host, at, pages in runs:
                staged[at : at + pages].copy_(self._host[first_host : first_host + pages], non_blocking=True)
            return count

        def scatter(lane: int, count: int) -> None:
            if self._table is not None:
                scatter_pages(
                    self._staged_words[lane], self._index[lane][:count], self._table, self._row_words
                )
                return
            for device, column in zip(self._device, self._columns[lane]):
                device.index_copy_(0, self._index[lane][:count], column[:count])

        def copy() -> None:
            kernels = self._kernels
            if kernels is None:  # one order for everything
                for number, (index, runs) in enumerate(chunks):
                    scatter(number % self.lanes, to_staging(number % self.lanes, index, runs))
                return
            copies = torch.cuda.current_stream(kernels.device)
            kernels.wait_stream(copies)  # after the compute stream's work on these pages
            for number, (index, runs) in enumerate(chunks):
                lane = number % self.lanes
                if number >= self.lanes:  # this lane's last scatter read it
                    copies.wait_event(self._lane_free[lane])
                count = to_staging(lane, index, runs)
                self._staged_ready[lane].record(copies)
                kernels.wait_event(self._staged_ready[lane])
                with torch.cuda.stream(kernels):
                    scatter(lane, count)
                self._lane_free[lane].record(kernels)
            copies.wait_stream(kernels)  # the copy's end (what the compute stream waits for) covers them

        return copy

    def _chunks(
        self, device_pages: torch.Tensor, host_pages: torch.Tensor
    ) -> list[tuple[torch.Tensor, list[tuple[int, int, int]]]]:
        """Per chunk: its device pages (int64 on the host; pinned on a GPU) and its host runs
        (first host page, place in the chunk, pages)."""
        if device_pages.shape != host_pages.shape or device_pages.dim() != 1:
            raise ValueError(f"page lists differ: {tuple(device_pages.shape)} and {tuple(host_pages.shape)}")
        device_list = device_pages.to("cpu", torch.int64)
        host_list = host_pages.to("cpu", torch.int64)
        chunks = []
        for start in range(0, int(device_list.numel()), self.chunk_pages):
            index = device_list[start : start + self.chunk_pages]
            index = index.pin_memory() if self._pin_index else index.clone()
            hosts = host_list[start : start + self.chunk_pages]
            runs = host_runs(hosts)
            chunks.append((index, runs))
            self.issued += 1 + len(runs) + (1 if self._table is not None else len(self._device))
        return chunks

    def _upload(self, index: torch.Tensor, lane: int) -> int:
        count = int(index.numel())
        self._index[lane][:count].copy_(index, non_blocking=True)
        return count


def chunk_pages_of(staging_bytes: int, page_bytes: int) -> int:
    """Pages a staging of `staging_bytes` carries at a time (each with its 8-byte index entry)."""
    return max(0, (staging_bytes - INDEX_ALIGN_BYTES) // (page_bytes + 8))


def page_runs(first: torch.Tensor, second: torch.Tensor) -> list[tuple[int, int, int]]:
    """Runs of pages consecutive in both lists: (first's start, second's start, count)."""
    if first.shape != second.shape or first.dim() != 1:
        raise ValueError(f"page lists differ: {tuple(first.shape)} and {tuple(second.shape)}")
    a, b = first.to(torch.int64), second.to(torch.int64)
    starts, ends = _run_bounds(int(a.numel()), (a[1:] - a[:-1] != 1) | (b[1:] - b[:-1] != 1))
    a_list, b_list = a.tolist(), b.tolist()
    return [(a_list[s], b_list[s], e - s) for s, e in zip(starts, ends)]


def host_runs(pages: torch.Tensor) -> list[tuple[int, int, int]]:
    """Runs of consecutive pages in one list: (first page, its place in the list, count)."""
    starts, ends = _run_bounds(int(pages.numel()), pages[1:] - pages[:-1] != 1)
    page_list = pages.tolist()
    return [(page_list[s], s, e - s) for s, e in zip(starts, ends)]


def _run_bounds(count: int, breaks_after: torch.Tensor) -> tuple[list[int], list[int]]:
    """Where the runs of a list of `count` start and end, from where it breaks (True at i: element
    i + 1 starts a run)."""
    if count == 0:
        return [], []
    starts = [0, *(torch.nonzero(breaks_after).reshape(-1) + 1).tolist()]
    return starts, [*starts[1:], count]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
