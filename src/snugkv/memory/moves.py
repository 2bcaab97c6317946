"""Page moves: the plan that lets a KV cache shrink under live requests without losing them.

A shrink needs every page above the new capacity free. Pages still in use there are moved to
free pages below it: the allocator plans the moves (`SlotAllocator.plan_shrink`) and takes them
into its bookkeeping (`apply_moves`), the pool copies the KV of every buffer (`KVPool.move_pages`),
and everything else that names slots rewrites them (`PageMoves.remap_slots`: the request-to-token
table, the prefix cache). A page moves whole and keeps each slot's offset in it, so a request's
token at position t stays at page offset `t % page_size`. This module only describes moves; it
never copies data and never decides which pages are in use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _no_pages() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True, slots=True)
class PageMoves:
    """Page `src_pages[i]` moves to page `dst_pages[i]` (int64 CPU tensors, `src_pages` ascending;
    no page is both a source and a destination)."""

    src_pages: torch.Tensor = field(default_factory=_no_pages)
    dst_pages: torch.Tensor = field(default_factory=_no_pages)

    def __post_init__(self) -> None:
        if self.src_pages.shape != self.dst_pages.shape or self.src_pages.dim() != 1:
            raise ValueError(
                f"page moves need two 1-D tensors of one length, got {tuple(self.src_pages.shape)} "
                f"and {tuple(self.dst_pages.shape)}"
            )

    @property
    def num_pages(self) -> int:
        return int(self.src_pages.numel())

    def slots(self, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot of the moved pages, source and destination, in the same order."""
        offsets = torch.arange(page_size, dtype=torch.int64)
        source = (self.src_pages[:, None] * page_size + offsets).reshape(-1)
        destination = (self.dst_pages[:, None] * page_size + offsets).reshape(-1)
        return source, destination

    def remap_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """`pages` with every moved page replaced by its destination (any device, any int dtype)."""
        if not self.num_pages or pages.numel() == 0:
            return pages
        source = self.src_pages.to(pages.device)
        index = torch.searchsorted(source, pages.to(torch.int64)).clamp(max=self.num_pages - 1)
        hit = source[index] == pages
        destination = self.dst_pages.to(pages.device)[index]
        return torch.where(hit, destination, pages.to(torch.int64)).to(pages.dtype)

    def remap_slots(self, slots: torch.Tensor, page_size: int) -> torch.Tensor:
        """`slots` with every slot of a moved page replaced by the same offset in its new page."""
        if not self.num_pages or slots.numel() == 0:
            return slots
        wide = slots.to(torch.int64)
        pages = self.remap_pages(wide // page_size)
        return (pages * page_size + wide % page_size).to(slots.dtype)


@dataclass(frozen=True, slots=True)
class KvMoves:
    """What a shrink moves: pages of the full pool (the slots the request table and the prefix cache
    name) and, for a sliding-window pool, pages of its window sub-pool (only the SWA allocator's own
    slot map names those)."""

    full: PageMoves = field(default_factory=PageMoves)
    window: PageMoves = field(default_factory=PageMoves)

    @property
    def num_pages(self) -> int:
        return self.full.num_pages + self.window.num_pages
