"""KV slot allocators: which slots of the KV pool are free, and who gets them next.

This module owns the free list of a KV pool (the second level of the mapping
request -> token slots -> KV data; see docs/ARCHITECTURE.md). It hands out slot indices and takes
them back; it never reads or writes KV data and never touches the request-to-token table.

The free list is a sorted CPU tensor of free page numbers, so allocation always takes the lowest
pages first: low memory is committed first, and a shrink only needs the top of the pool free.
Freed pages wait in a small pending list and are merged into the free list (one vectorised
O(n) merge, no per-token Python loops) by the next operation that hands pages out or resizes, so
the many frees of one scheduler step cost one merge.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from snugkv.memory.moves import KvMoves, PageMoves

DEBUG_ENV_VAR = "SNUGKV_DEBUG_ALLOCATOR"
_CPU = torch.device("cpu")


class AllocatorIntegrityError(RuntimeError):
    """The allocator's bookkeeping broke one of its invariants (a bug, never a user error)."""


def debug_from_env() -> bool:
    """Whether SNUGKV_DEBUG_ALLOCATOR asks for an integrity check after every operation."""
    return os.environ.get(DEBUG_ENV_VAR, "").strip().lower() in {"1", "true", "yes", "on"}


def as_cpu_int64(values: torch.Tensor | list[int] | int, what: str) -> torch.Tensor:
    """`values` as a flat int64 CPU tensor (the free lists and their arithmetic live on the CPU)."""
    tensor = torch.as_tensor(values)
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        raise TypeError(f"{what} must hold integers, got dtype {tensor.dtype}")
    return tensor.to(device=_CPU, dtype=torch.int64).reshape(-1)


@runtime_checkable
class SlotAllocator(Protocol):
    """Hands out KV slots of one pool; the contract every allocator keeps.

    - Slot `s` lies in page `s // page_size`. Page 0 (slots 0..page_size-1) is the dummy page:
      it is never handed out and never free. Usable slots are `[page_size, capacity_tokens +
      page_size)`, so `capacity_tokens` counts usable tokens and excludes the dummy page.
    - Whoever allocates frees: the scheduler frees a request's slots when the request finishes
      (or hands them to the prefix cache, which then frees them on eviction). The allocator
      never frees on its own and never reclaims slots behind the caller's back.
    - Pages are the unit. `free` takes any slots of a page and frees the whole page once, even
      if the page is named several times in one call. Freeing a page that is not allocated is a
      double free and raises `ValueError` naming the slot.
    - In a request, the token at position t sits at page offset `t % page_size`. `alloc_extend`
      and `alloc_decode` keep that: they first fill the request's last partial page, then take
      whole new pages; the unused tail of a request's last page stays reserved for it.
    - `alloc*` return int64 slots on `device`, or None when not enough is free (state unchanged).
    - Inputs may live on any device; the free list lives on the CPU.
    - With `debug` on (ctor flag or SNUGKV_DEBUG_ALLOCATOR=1), `check_integrity` runs after
      every operation.
    """

    @property
    def page_size(self) -> int: ...

    @property
    def capacity_tokens(self) -> int:
        """Usable tokens (the dummy page excluded)."""
        ...

    @property
    def available_tokens(self) -> int: ...

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """`num_tokens` slots in whole pages (a multiple of page_size); None when they do not fit."""
        ...

    def alloc_extend(
        self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """Slots for positions `prefix_lens[i]..seq_lens[i]-1` of every request, concatenated in
        request order. `last_loc[i]` is the slot of request i's last cached token (-1 for none);
        it is only read when the request's last page is partial."""
        ...

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        """One slot per request for position `seq_lens[i] - 1` (seq_lens include the new token)."""
        ...

    def free(self, slots: torch.Tensor | list[int]) -> None: ...

    def resize(self, capacity_tokens: int) -> None:
        """Set the usable capacity (a page multiple). Shrinking needs every slot above it free."""
        ...

    def plan_shrink(self, capacity_tokens: int) -> KvMoves | None:
        """Moves that free every page above `capacity_tokens`: each handed-out page there goes to
        the lowest free page below it. None when too few pages below are free. Changes nothing."""
        ...

    def apply_moves(self, moves: KvMoves) -> None:
        """Take a plan from `plan_shrink` into the bookkeeping (destinations handed out, sources
        free). The caller copies the KV and rewrites whatever names the moved slots."""
        ...

    def check_integrity(self) -> None:
        """Raise `AllocatorIntegrityError` if the bookkeeping broke an invariant."""
        ...


class PageFreeList(ABC):
    """The free-list machinery the token and paged allocators share (see `SlotAllocator`)."""

    def __init__(
        self,
        capacity_tokens: int,
        page_size: int,
        device: torch.device | str = "cpu",
        debug: bool | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self._page_size = page_size
        self.device = torch.device(device)
        self.debug = debug_from_env() if debug is None else debug
        self._num_pages = 1  # including the dummy page
        self._page_in_use = torch.zeros(1, dtype=torch.bool)
        self._free_pages = torch.empty(0, dtype=torch.int64)  # sorted
        self._released: list[torch.Tensor] = []  # freed since the last merge, each sorted
        self.resize(capacity_tokens)

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def capacity_tokens(self) -> int:
        """Usable tokens (the dummy page excluded)."""
        return (self._num_pages - 1) * self._page_size

    @property
    def available_tokens(self) -> int:
        return self.available_pages * self._page_size

    @property
    def available_pages(self) -> int:
        return self._free_pages.numel() + sum(pages.numel() for pages in self._released)

    def allocated_pages(self) -> torch.Tensor:
        """Sorted int64 CPU tensor of the pages currently handed out."""
        return torch.nonzero(self._page_in_use).reshape(-1)

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """`num_tokens` slots in whole pages (a multiple of page_size), lowest pages first."""
        if num_tokens < 0 or num_tokens % self._page_size:
            raise ValueError(
                f"alloc needs a non-negative multiple of page_size={self._page_size} tokens, got {num_tokens}"
            )
        pages = self._take_pages(num_tokens // self._page_size)
        if pages is None:
            return None
        offsets = torch.arange(self._page_size, dtype=torch.int64)
        return self._done((pages[:, None] * self._page_size + offsets).reshape(-1))

    def free(self, slots: torch.Tensor | list[int]) -> None:
        """Free every page that holds one of `slots` (each page once)."""
        slots_cpu = as_cpu_int64(slots, "slots")
        if slots_cpu.numel() == 0:
            return
        pages = self._pages_in_use_of(slots_cpu)
        self._page_in_use[pages] = False
        self._released.append(pages)
        self._done(None)

    @abstractmethod
    def alloc_extend(
        self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """Slots for positions `prefix_lens[i]..seq_lens[i]-1` of every request, concatenated in
        request order. `last_loc[i]` is the slot of request i's last cached token (-1 for none);
        it is only read when the request's last page is partial."""

    @abstractmethod
    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        """One slot per request for position `seq_lens[i] - 1` (seq_lens include the new token)."""

    def _check_capacity(self, capacity_tokens: int) -> None:
        if capacity_tokens < 0 or capacity_tokens % self._page_size:
            raise ValueError(
                f"capacity must be a non-negative multiple of page_size={self._page_size}, got {capacity_tokens}"
            )

    def resize(self, capacity_tokens: int) -> None:
        """Set the usable capacity. Shrinking needs every slot above the new capacity free."""
        self._check_capacity(capacity_tokens)
        new_num_pages = capacity_tokens // self._page_size + 1
        old_num_pages = self._num_pages
        self._merge_released()
        if new_num_pages > old_num_pages:
            grown = torch.zeros(new_num_pages - old_num_pages, dtype=torch.bool)
            self._page_in_use = torch.cat([self._page_in_use, grown])
            new_pages = torch.arange(old_num_pages, new_num_pages, dtype=torch.int64)
            self._free_pages = torch.cat([self._free_pages, new_pages])
        elif new_num_pages < old_num_pages:
            used_above = torch.nonzero(self._page_in_use[new_num_pages:]).reshape(-1)
            if used_above.numel():
                first_slot = (int(used_above[0]) + new_num_pages) * self._page_size
                raise ValueError(
                    f"cannot shrink the pool to {capacity_tokens} tokens: {used_above.numel()} page(s) above "
                    f"the new capacity are still allocated (lowest holds slot {first_slot}); "
                    "free them first"
                )
            self._page_in_use = self._page_in_use[:new_num_pages].clone()
            keep = int(torch.searchsorted(self._free_pages, new_num_pages))
            self._free_pages = self._free_pages[:keep]
        self._num_pages = new_num_pages
        self._done(None)

    def plan_shrink(self, capacity_tokens: int) -> KvMoves | None:
        """See `SlotAllocator.plan_shrink`."""
        pages = self.plan_page_moves(capacity_tokens)
        return None if pages is None else KvMoves(full=pages)

    def plan_page_moves(self, capacity_tokens: int) -> PageMoves | None:
        """Handed-out pages above `capacity_tokens` paired with the lowest free pages below it."""
        self._check_capacity(capacity_tokens)
        self._merge_released()
        new_num_pages = capacity_tokens // self._page_size + 1
        if new_num_pages >= self._num_pages:
            return PageMoves()
        sources = torch.nonzero(self._page_in_use[new_num_pages:]).reshape(-1) + new_num_pages
        free_below = self._free_pages[: int(torch.searchsorted(self._free_pages, new_num_pages))]
        if sources.numel() > free_below.numel():
            return None
        return PageMoves(sources, free_below[: sources.numel()].clone())

    def apply_moves(self, moves: KvMoves) -> None:
        """See `SlotAllocator.apply_moves`."""
        self.apply_page_moves(moves.full)

    def apply_page_moves(self, moves: PageMoves) -> None:
        if not moves.num_pages:
            return
        self._merge_released()
        sources, destinations = moves.src_pages, moves.dst_pages
        if not bool(self._page_in_use[sources].all()) or bool(self._page_in_use[destinations].any()):
            raise ValueError("page moves must go from handed-out pages to free ones; plan them again")
        self._page_in_use[sources] = False
        self._page_in_use[destinations] = True
        keep = ~torch.isin(self._free_pages, destinations)
        self._free_pages = _merge_sorted(self._free_pages[keep], torch.sort(sources).values)
        self._done(None)

    def check_integrity(self) -> None:
        """Raise AllocatorIntegrityError unless the free list and the in-use set partition the
        usable pages exactly and the dummy page is neither free nor handed out."""
        free, in_use = torch.cat([self._free_pages, *self._released]), self._page_in_use
        name = type(self).__name__
        if in_use.numel() != self._num_pages:
            raise AllocatorIntegrityError(
                f"{name}: in-use map covers {in_use.numel()} pages, pool has {self._num_pages}"
            )
        if bool(in_use[0]):
            raise AllocatorIntegrityError(f"{name}: the dummy page 0 is marked as handed out")
        unsorted = torch.nonzero(self._free_pages[1:] <= self._free_pages[:-1]).reshape(-1)
        if unsorted.numel():
            page = int(self._free_pages[int(unsorted[0]) + 1])
            raise AllocatorIntegrityError(f"{name}: free list is not strictly sorted at page {page}")
        if free.numel():
            outside = free[(free < 1) | (free >= self._num_pages)]
            if outside.numel():
                raise AllocatorIntegrityError(
                    f"{name}: free list holds page {int(outside[0])}, outside the usable pages "
                    f"1..{self._num_pages - 1}"
                )
            pages, counts = torch.unique(free, return_counts=True)
            if bool((counts > 1).any()):
                raise AllocatorIntegrityError(
                    f"{name}: page {int(pages[counts > 1][0])} is free twice (it would be handed out twice)"
                )
            both = free[in_use[free]]
            if both.numel():
                raise AllocatorIntegrityError(f"{name}: page {int(both[0])} is both free and handed out")
        used = int(in_use.sum())
        if used + free.numel() != self._num_pages - 1:
            raise AllocatorIntegrityError(
                f"{name}: {free.numel()} free + {used} used pages != {self._num_pages - 1} usable pages"
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(page_size={self._page_size}, capacity_tokens={self.capacity_tokens}, "
            f"available_tokens={self.available_tokens}, device={self.device})"
        )

    # -- shared machinery -------------------------------------------------------------------------

    def _take_pages(self, num_pages: int) -> torch.Tensor | None:
        if num_pages > self.available_pages:
            return None
        self._merge_released()
        pages = self._free_pages[:num_pages]
        self._free_pages = self._free_pages[num_pages:]
        self._page_in_use[pages] = True
        return pages

    def _pages_in_use_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Unique sorted pages of `slots`, after checking every one is handed out."""
        pool_slots = self._num_pages * self._page_size
        outside = (slots < self._page_size) | (slots >= pool_slots)
        if bool(outside.any()):
            slot = int(slots[outside][0])
            where = "in the dummy page" if 0 <= slot < self._page_size else "outside the pool"
            raise ValueError(
                f"slot {slot} is {where}; handed-out slots are {self._page_size}..{pool_slots - 1}"
            )
        not_in_use = ~self._page_in_use[slots // self._page_size]
        if bool(not_in_use.any()):
            slot = int(slots[not_in_use][0])
            raise ValueError(f"double free: slot {slot} (page {slot // self._page_size}) is not allocated")
        return torch.unique(slots // self._page_size)

    def _check_last_loc(self, rows: torch.Tensor, last_loc: torch.Tensor, last_pos: torch.Tensor) -> None:
        """Each request that continues a partial page must name an allocated slot at the page
        offset of its last cached position."""
        bad = (last_loc < self._page_size) | (last_loc >= self._num_pages * self._page_size)
        safe = torch.where(bad, 0, last_loc)
        bad |= ~self._page_in_use[safe // self._page_size]
        bad |= safe % self._page_size != last_pos % self._page_size
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"request {int(rows[i])}: last_loc={int(last_loc[i])} is not an allocated slot at page "
                f"offset {int(last_pos[i]) % self._page_size} (its last cached position is "
                f"{int(last_pos[i])}, page_size={self._page_size}); pass the slot of that token"
            )

    def _is_last_loc(self, last_loc: int, last_pos: int) -> bool:
        """`_check_last_loc`'s rule for one request, on Python ints (False: that check raises)."""
        size = self._page_size
        return (
            size <= last_loc < self._num_pages * size
            and bool(self._page_in_use[last_loc // size])
            and last_loc % size == last_pos % size
        )

    def _merge_released(self) -> None:
        if self._released:
            released = torch.sort(torch.cat(self._released)).values
            self._free_pages = _merge_sorted(self._free_pages, released)
            self._released.clear()

    def _done(self, result: torch.Tensor | None) -> torch.Tensor | None:
        if self.debug:
            self.check_integrity()
        return None if result is None else result.to(self.device)


# An extension of at most this many tokens is allocated in plain Python (`_alloc_extend_small`): a
# verify step's rows, a short chunk; larger ones (prefill chunks) by tensor ops, whose fixed cost
# amortizes over their tokens.
SMALL_EXTEND_TOKENS = 256


def _merge_sorted(free_pages: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Merge sorted `pages` (none of them in `free_pages`) into the sorted free list in O(n).

    numpy's insert is one linear pass; torch has no merge, and its scatter-based equivalent is
    3-5x slower on a CPU (15 ms against 3 ms for a 1.7M-page free list)."""
    free_np, pages_np = free_pages.numpy(), pages.numpy()
    return torch.from_numpy(np.insert(free_np, np.searchsorted(free_np, pages_np), pages_np))


def check_lens(prefix_lens: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """prefix_lens and seq_lens as int64 CPU tensors, after checking 0 <= prefix <= seq per request."""
    prefix, seq = as_cpu_int64(prefix_lens, "prefix_lens"), as_cpu_int64(seq_lens, "seq_lens")
    if prefix.shape != seq.shape:
        raise ValueError(f"prefix_lens has {prefix.numel()} requests but seq_lens has {seq.numel()}")
    bad = (prefix < 0) | (seq < prefix)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"request {i}: need 0 <= prefix_len <= seq_len, got {int(prefix[i])} and {int(seq[i])}"
        )
    return prefix, seq


def few_extend_lens(
    prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor
) -> tuple[list[int], list[int], list[int]] | None:
    """The three as checked lists when they extend by at most `SMALL_EXTEND_TOKENS` tokens in all
    (else None: the tensor path, which runs `check_lens` itself); the same checks and messages."""
    if torch.as_tensor(prefix_lens).numel() > SMALL_EXTEND_TOKENS:
        return None
    prefix, seq = _int_list(prefix_lens, "prefix_lens"), _int_list(seq_lens, "seq_lens")
    if len(prefix) != len(seq) or any(start < 0 or end < start for start, end in zip(prefix, seq)):
        check_lens(prefix_lens, seq_lens)  # raises, naming the request
    if sum(seq) - sum(prefix) > SMALL_EXTEND_TOKENS:
        return None
    last = _int_list(last_loc, "last_loc")
    if len(last) != len(prefix):
        check_last_loc_shape(torch.as_tensor(last_loc), torch.as_tensor(prefix))  # raises
    return prefix, seq, last


def _int_list(values: torch.Tensor | list[int], what: str) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise TypeError(f"{what} must hold integers, got dtype {values.dtype}")
        return values.reshape(-1).tolist()
    return as_cpu_int64(values, what).tolist()


def check_decode_lens(seq_lens: torch.Tensor) -> torch.Tensor:
    """Decode seq_lens (which include the new token) as an int64 CPU tensor, all >= 1."""
    seq = as_cpu_int64(seq_lens, "seq_lens")
    if bool((seq < 1).any()):
        raise ValueError(f"decode seq_lens include the new token and must be >= 1, got {seq.tolist()}")
    return seq


def check_last_loc_shape(last_loc: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    last = as_cpu_int64(last_loc, "last_loc")
    if last.shape != lens.shape:
        raise ValueError(f"last_loc has {last.numel()} entries but the batch has {lens.numel()} requests")
    return last


class TokenAllocator(PageFreeList):
    """page_size 1: every slot is its own page, so there is never a partial page to fill."""

    def __init__(
        self, capacity_tokens: int, device: torch.device | str = "cpu", debug: bool | None = None
    ) -> None:
        super().__init__(capacity_tokens, page_size=1, device=device, debug=debug)

    def alloc_extend(
        self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        prefix, seq = check_lens(prefix_lens, seq_lens)
        return self.alloc(int((seq - prefix).sum()))

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        return self.alloc(check_decode_lens(seq_lens).numel())


class PagedAllocator(PageFreeList):
    """page_size > 1: whole pages, with each request's last partial page filled first."""

    def __init__(
        self,
        capacity_tokens: int,
        page_size: int,
        device: torch.device | str = "cpu",
        debug: bool | None = None,
    ) -> None:
        if page_size < 2:
            raise ValueError(
                f"PagedAllocator needs page_size >= 2, got {page_size}; use TokenAllocator for 1"
            )
        super().__init__(capacity_tokens, page_size=page_size, device=device, debug=debug)

    def alloc_extend(
        self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        few = few_extend_lens(prefix_lens, seq_lens, last_loc)
        if few is not None:
            return self._alloc_extend_small(*few)
        prefix, seq = check_lens(prefix_lens, seq_lens)
        last = check_last_loc_shape(last_loc, prefix)
        size = self.page_size
        extend = seq - prefix
        pages_before = (prefix + size - 1) // size
        new_pages = (seq + size - 1) // size - pages_before
        fills = torch.nonzero((prefix % size != 0) & (extend > 0)).reshape(-1)
        self._check_last_loc(fills, last[fills], prefix[fills] - 1)
        pages = self._take_pages(int(new_pages.sum()))
        if pages is None:
            return None
        row = torch.repeat_interleave(torch.arange(prefix.numel()), extend)
        first_token = torch.cumsum(extend, 0) - extend
        pos = prefix[row] + torch.arange(row.numel()) - first_token[row]
        in_partial = pos < pages_before[row] * size
        slots = torch.empty(row.numel(), dtype=torch.int64)
        slots[in_partial] = (last[row] + pos - prefix[row] + 1)[in_partial]
        fresh = ~in_partial
        first_page = torch.cumsum(new_pages, 0) - new_pages
        page_index = (first_page[row] + pos // size - pages_before[row])[fresh]
        slots[fresh] = pages[page_index] * size + pos[fresh] % size
        return self._done(slots)

    def _alloc_extend_small(self, prefix: list[int], seq: list[int], last: list[int]) -> torch.Tensor | None:
        """`alloc_extend` of a few tokens (a verify step's, a short chunk's) in plain Python: the same
        slots and pages as the tensor path, without its ~25 tensor ops of fixed cost (0.4-0.5 ms on a
        CPU for one row of five tokens, where the device waited on it between verify steps)."""
        size = self.page_size
        new_pages = 0
        for row, (start, end, loc) in enumerate(zip(prefix, seq, last)):
            if end > start and start % size and not self._is_last_loc(loc, start - 1):
                self._check_last_loc(torch.tensor([row]), torch.tensor([loc]), torch.tensor([start - 1]))
            new_pages += -(-end // size) - -(-start // size)
        taken = self._take_pages(new_pages) if new_pages else None
        if new_pages and taken is None:
            return None
        pages = iter(taken.tolist() if taken is not None else ())
        slots: list[int] = []
        for start, end, loc in zip(prefix, seq, last):
            partial_end = min(end, -(-start // size) * size)  # the rest of the partial last page
            slots.extend(range(loc + 1, loc + 1 + partial_end - start))
            position = partial_end
            while position < end:
                base = next(pages) * size
                count = min(size, end - position)
                slots.extend(range(base, base + count))
                position += count
        return self._done(torch.tensor(slots, dtype=torch.int64))

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        seq = check_decode_lens(seq_lens)
        last = check_last_loc_shape(last_loc, seq)
        needs_page = (seq - 1) % self.page_size == 0
        fills = torch.nonzero(~needs_page).reshape(-1)
        self._check_last_loc(fills, last[fills], seq[fills] - 2)
        pages = self._take_pages(int(needs_page.sum()))
        if pages is None:
            return None
        slots = last + 1
        slots[needs_page] = pages * self.page_size
        return self._done(slots)


def make_allocator(
    capacity_tokens: int, page_size: int, device: torch.device | str = "cpu", debug: bool | None = None
) -> PageFreeList:
    """The allocator for `page_size`: TokenAllocator for 1, PagedAllocator above."""
    if page_size == 1:
        return TokenAllocator(capacity_tokens, device=device, debug=debug)
    return PagedAllocator(capacity_tokens, page_size, device=device, debug=debug)
