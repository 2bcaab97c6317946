"""A copier for tests that holds every copy back until someone waits for it (or `flush`), in order,
as one copy stream would: what reads or reuses a page before its copy ran shows up as wrong bytes.
And a staging buffer of a given number of pages for the batched copy path."""

from __future__ import annotations

from collections.abc import Callable

import torch

from snugkv.memory.host_tier import CopyDone, PageCopies
from snugkv.memory.tier_copies import INDEX_ALIGN_BYTES


def staging_for(pages: int, page_bytes: int) -> torch.Tensor:
    """A staging (CPU) that carries exactly `pages` pages a chunk."""
    return torch.zeros(INDEX_ALIGN_BYTES + pages * (page_bytes + 8), dtype=torch.uint8)


class HeldCopies(PageCopies):
    def __init__(self) -> None:
        self.queue: list[tuple[Callable[[], None], HeldCopy]] = []
        self.ran = 0

    def run(self, copy: Callable[[], None], *, load: bool) -> CopyDone:
        done = HeldCopy(self)
        self.queue.append((copy, done))
        return done

    def order_after_compute(self) -> None:
        return None

    def elapsed_s(self) -> tuple[float, float]:
        return 0.0, 0.0

    @property
    def pending(self) -> int:
        return len(self.queue)

    def run_until(self, done: HeldCopy | None) -> None:
        """Run the held copies in order, up to `done` (None: all)."""
        while self.queue:
            copy, current = self.queue.pop(0)
            copy()
            current.ran = True
            self.ran += 1
            if current is done:
                return

    def flush(self) -> None:
        self.run_until(None)


class HeldCopy(CopyDone):
    def __init__(self, copies: HeldCopies) -> None:
        self.copies = copies
        self.ran = False

    def wait(self) -> None:
        if not self.ran:
            self.copies.run_until(self)
