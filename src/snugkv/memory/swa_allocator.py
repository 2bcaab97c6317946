"""Slot allocation for sliding-window models: a full-attention pool plus a window pool.

This module owns the pairing between the two sub-pools. Every token gets a slot in the full pool
(the slot the rest of the engine sees, the one in the request-to-token table) and, while it is
inside the window, a slot in the window pool. `full_to_swa[full_slot]` gives the window slot;
the tensor lives in pool memory (the caller passes it in) and this allocator keeps it up to date.
It never reads or writes KV data.

Pairing is per page: a full page is paired with one window page, and a token at page offset o of
full page f sits at offset o of the paired window page. So `full_to_swa[f*P + o] = w*P + o` for
every written slot, the dummy page maps to itself, and everything else maps to 0 (the window
pool's dummy slot).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from snugkv.memory.allocator import (
    AllocatorIntegrityError,
    as_cpu_int64,
    check_decode_lens,
    check_last_loc_shape,
    check_lens,
    debug_from_env,
    make_allocator,
)
from snugkv.memory.moves import KvMoves


class SWAAllocator:
    """Allocates full-pool slots and their paired window-pool slots together.

    Contract (on top of SlotAllocator's): `free(full_slots)` frees both sides of each page it
    names; `free_swa(full_slots)` frees only the window pages of tokens that left the window and
    sets their mapping back to 0. Both work on whole pages, so with page_size > 1 the caller
    passes `free_swa` only pages whose every token has left the window. Freeing a window page
    twice is a `ValueError` naming the slot.
    """

    def __init__(
        self,
        full_tokens: int,
        swa_tokens: int,
        page_size: int,
        full_to_swa: torch.Tensor,
        device: torch.device | str | None = None,
        debug: bool | None = None,
        swa_tokens_for: Callable[[int], int] | None = None,
    ) -> None:
        """`swa_tokens_for(full_tokens)`: the window pool's size for a full-pool size, which `resize`
        follows (the pool's own split; default: the ratio given here)."""
        ratio = swa_tokens / full_tokens if full_tokens else 1.0
        self._swa_tokens_for = swa_tokens_for or (lambda full: int(full * ratio) // page_size * page_size)
        self.device = full_to_swa.device if device is None else torch.device(device)
        self._full = make_allocator(full_tokens, page_size, debug=False)
        self._swa = make_allocator(swa_tokens, page_size, debug=False)
        self.debug = debug_from_env() if debug is None else debug
        self._page_size = page_size
        self._check_mapping(full_to_swa, full_tokens)
        self.full_to_swa = full_to_swa
        # only the live range: a longer mapping may be a view over memory not committed yet
        full_to_swa[: full_tokens + page_size] = 0
        full_to_swa[:page_size] = torch.arange(page_size, device=full_to_swa.device)
        # paired window page of every full page; 0 = none (page 0, the dummy, is never paired)
        self._swa_page_of = torch.zeros(full_tokens // page_size + 1, dtype=torch.int64)
        self._after_op()

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def capacity_tokens(self) -> int:
        """Tokens a request may hold at once: every token needs a full slot, and a window slot while in it."""
        return min(self.full_capacity_tokens, self.swa_capacity_tokens)

    @property
    def full_capacity_tokens(self) -> int:
        return self._full.capacity_tokens

    @property
    def swa_capacity_tokens(self) -> int:
        return self._swa.capacity_tokens

    @property
    def full_available_tokens(self) -> int:
        return self._full.available_tokens

    @property
    def swa_available_tokens(self) -> int:
        return self._swa.available_tokens

    @property
    def available_tokens(self) -> int:
        """Tokens both pools can still take (a fresh allocation needs a slot in each)."""
        return min(self._full.available_tokens, self._swa.available_tokens)

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """`num_tokens` full slots (whole pages) with their window slots; returns the full slots."""
        if num_tokens // self._page_size > self._swa.available_pages:
            return None
        return self._pair(self._full.alloc(num_tokens))

    def alloc_extend(
        self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """As SlotAllocator.alloc_extend; `last_loc` holds full-pool slots."""
        prefix, seq = check_lens(prefix_lens, seq_lens)
        last = check_last_loc_shape(last_loc, prefix)
        size = self._page_size
        new_pages = (seq + size - 1) // size - (prefix + size - 1) // size
        fills = (prefix % size != 0) & (seq > prefix)
        needed = int(new_pages.sum()) + self._unpaired_partial_pages(last[fills])
        if needed > self._swa.available_pages:
            return None
        return self._pair(self._full.alloc_extend(prefix, seq, last))

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        """As SlotAllocator.alloc_decode; `last_loc` holds full-pool slots."""
        seq = check_decode_lens(seq_lens)
        last = check_last_loc_shape(last_loc, seq)
        needs_page = (seq - 1) % self._page_size == 0
        needed = int(needs_page.sum()) + self._unpaired_partial_pages(last[~needs_page])
        if needed > self._swa.available_pages:
            return None
        return self._pair(self._full.alloc_decode(seq, last))

    def free(self, full_slots: torch.Tensor | list[int]) -> None:
        """Free the full pages holding `full_slots` and whatever window pages they still have."""
        slots = as_cpu_int64(full_slots, "full_slots")
        if slots.numel() == 0:
            return
        self._full.free(slots)  # validates (double free raises) before anything changes
        full_pages = torch.unique(slots // self._page_size)
        swa_pages = self._swa_page_of[full_pages]
        self._swa.free(swa_pages[swa_pages != 0] * self._page_size)
        self._unpair(full_pages)

    def free_swa(self, full_slots: torch.Tensor | list[int]) -> None:
        """Free only the window pages of the full pages holding `full_slots` (out of the window)."""
        slots = as_cpu_int64(full_slots, "full_slots")
        if slots.numel() == 0:
            return
        outside = (slots < self._page_size) | (slots >= self._swa_page_of.numel() * self._page_size)
        safe = torch.where(outside, 0, slots)
        unpaired = outside | (self._swa_page_of[safe // self._page_size] == 0)
        if bool(unpaired.any()):
            slot = int(slots[unpaired][0])
            raise ValueError(
                f"free_swa: full slot {slot} has no window slot (never allocated, or its window "
                "slot was already freed)"
            )
        full_pages = torch.unique(slots // self._page_size)
        self._swa.free(self._swa_page_of[full_pages] * self._page_size)
        self._unpair(full_pages)

    def resize(self, capacity_tokens: int) -> None:
        """Resize to `capacity_tokens` full-pool tokens, the window pool following its split."""
        self.resize_groups(capacity_tokens, self._swa_tokens_for(capacity_tokens))

    def resize_groups(
        self, full_tokens: int, swa_tokens: int, full_to_swa: torch.Tensor | None = None
    ) -> None:
        """Set both capacities (shrinking needs the slots above free in that pool).

        Pass `full_to_swa` when the pool moved the mapping to a larger tensor; its live entries
        are copied over from the current one, so keep the current one valid until this returns.
        """
        mapping = self.full_to_swa if full_to_swa is None else full_to_swa
        self._check_mapping(mapping, full_tokens)
        old_full_tokens = self._full.capacity_tokens
        self._full.resize(full_tokens)
        try:
            self._swa.resize(swa_tokens)
        except ValueError:
            self._full.resize(old_full_tokens)
            raise
        live = min(old_full_tokens, full_tokens) + self._page_size
        if mapping is not self.full_to_swa:
            mapping[:live].copy_(self.full_to_swa[:live])
        mapping[live : full_tokens + self._page_size] = 0
        self.full_to_swa = mapping
        num_pages = full_tokens // self._page_size + 1
        grown = torch.zeros(max(0, num_pages - self._swa_page_of.numel()), dtype=torch.int64)
        self._swa_page_of = torch.cat([self._swa_page_of[:num_pages], grown])
        self._after_op()

    def plan_shrink(self, capacity_tokens: int) -> KvMoves | None:
        """As SlotAllocator.plan_shrink: full pages above `capacity_tokens` and window pages above
        the window pool's share of it, each to the lowest free page below its bound."""
        full = self._full.plan_page_moves(capacity_tokens)
        window = self._swa.plan_page_moves(self._swa_tokens_for(capacity_tokens))
        if full is None or window is None:
            return None
        return KvMoves(full=full, window=window)

    def apply_moves(self, moves: KvMoves) -> None:
        """As SlotAllocator.apply_moves; also re-pairs the moved pages and rewrites `full_to_swa`."""
        size, mapping = self._page_size, self.full_to_swa
        offsets = torch.arange(size, dtype=torch.int64)
        self._full.apply_page_moves(moves.full)
        self._swa.apply_page_moves(moves.window)
        if moves.full.num_pages:  # a full page takes its window page (and mapping) along
            sources, destinations = moves.full.slots(size)
            mapping[destinations.to(mapping.device)] = mapping[sources.to(mapping.device)]
            mapping[sources.to(mapping.device)] = 0
            self._swa_page_of[moves.full.dst_pages] = self._swa_page_of[moves.full.src_pages]
            self._swa_page_of[moves.full.src_pages] = 0
        if moves.window.num_pages:  # the full pages paired with a moved window page follow it
            full_pages = torch.nonzero(torch.isin(self._swa_page_of, moves.window.src_pages)).reshape(-1)
            window_pages = moves.window.remap_pages(self._swa_page_of[full_pages])
            self._swa_page_of[full_pages] = window_pages
            slots = (full_pages[:, None] * size + offsets).reshape(-1).to(mapping.device)
            moved = (window_pages[:, None] * size + offsets).reshape(-1).to(mapping.device)
            mapping[slots] = torch.where(mapping[slots] != 0, moved, 0)
        self._after_op()

    def check_integrity(self) -> None:
        """Raise AllocatorIntegrityError unless both pools are sound, window pages are paired
        one-to-one with allocated full pages, and the mapping agrees with the pairing."""
        self._full.check_integrity()
        self._swa.check_integrity()
        size, pairing = self._page_size, self._swa_page_of
        if pairing.numel() != self._full.capacity_tokens // size + 1 or int(pairing[0]) != 0:
            raise AllocatorIntegrityError("SWAAllocator: page pairing table does not match the full pool")
        paired = torch.nonzero(pairing).reshape(-1)
        unowned = paired[~torch.isin(paired, self._full.allocated_pages())]
        if unowned.numel():
            raise AllocatorIntegrityError(
                f"SWAAllocator: free full page {int(unowned[0])} still has a window page"
            )
        if not torch.equal(torch.sort(pairing[paired]).values, self._swa.allocated_pages()):
            raise AllocatorIntegrityError(
                "SWAAllocator: allocated window pages are not exactly the paired ones "
                "(a window page is paired twice, leaked, or paired while free)"
            )
        if self._full.capacity_tokens == 0:  # names no slot; its pool may be released (the engine sleeps)
            return
        mapping = self.full_to_swa[: self._full.capacity_tokens + size].to("cpu").view(-1, size)
        offsets = torch.arange(size, dtype=torch.int64)
        if not torch.equal(mapping[0], offsets):
            raise AllocatorIntegrityError("SWAAllocator: the dummy page does not map to itself")
        expected = pairing[:, None] * size + offsets
        wrong = (mapping != 0) & ((mapping != expected) | (pairing[:, None] == 0))
        wrong[0] = False
        if bool(wrong.any()):
            slot = int(torch.nonzero(wrong.reshape(-1))[0])
            raise AllocatorIntegrityError(
                f"SWAAllocator: full_to_swa[{slot}] = {int(mapping.reshape(-1)[slot])} disagrees with the "
                f"page pairing (expected {int(expected.reshape(-1)[slot])} or 0)"
            )

    def __repr__(self) -> str:
        return f"SWAAllocator(full={self._full!r}, swa={self._swa!r})"

    # -- pairing ----------------------------------------------------------------------------------

    def _unpaired_partial_pages(self, last_loc: torch.Tensor) -> int:
        """How many of the partial pages being continued lost their window page (out-of-range
        slots count as paired here; the full allocator then rejects them with a clear message)."""
        pages = last_loc // self._page_size
        pages = pages[(pages > 0) & (pages < self._swa_page_of.numel())]
        return int((self._swa_page_of[pages] == 0).sum())

    def _pair(self, full_slots: torch.Tensor | None) -> torch.Tensor | None:
        """Give every full page in `full_slots` that has no window page one, then map the slots."""
        if full_slots is None:
            return None
        slots = full_slots.to("cpu")
        size = self._page_size
        pages = torch.unique(slots // size)
        unpaired = pages[self._swa_page_of[pages] == 0]
        swa_slots = self._swa.alloc(unpaired.numel() * size)
        if swa_slots is None:  # the callers counted the pages first, so this is a bug
            raise AllocatorIntegrityError("SWAAllocator: window pool ran out after the pre-check")
        self._swa_page_of[unpaired] = swa_slots.view(-1, size)[:, 0] // size
        window = self._swa_page_of[slots // size] * size + slots % size
        target = self.full_to_swa.device
        self.full_to_swa[slots.to(target)] = window.to(target)
        self._after_op()
        return full_slots.to(self.device)

    def _unpair(self, full_pages: torch.Tensor) -> None:
        self._swa_page_of[full_pages] = 0
        slots = (full_pages[:, None] * self._page_size + torch.arange(self._page_size)).reshape(-1)
        self.full_to_swa[slots.to(self.full_to_swa.device)] = 0
        self._after_op()

    def _check_mapping(self, mapping: torch.Tensor, full_tokens: int) -> None:
        needed = full_tokens + self._page_size
        if mapping.dtype != torch.int64 or mapping.dim() != 1 or mapping.numel() < needed:
            raise ValueError(
                f"full_to_swa must be a 1-D int64 tensor of at least full_tokens + page_size = {needed} "
                f"entries, got {mapping.dtype} of shape {tuple(mapping.shape)}"
            )

    def _after_op(self) -> None:
        if self.debug:
            self.check_integrity()
