"""The virtual-memory interface every backend implements, and the choice of backend.

A backend reserves address space without physical memory, commits (backs) spans of it,
decommits them and releases the range. One `commit` creates exactly one backing
extension: callers grow a buffer by committing the next span in one call, never in
granule-sized loops. This module must never import a CUDA library at import time:
importing snugkv on a CPU machine always works.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

GIB = 1 << 30
MIB = 1 << 20
KIB = 1 << 10


class VmmError(RuntimeError):
    """A virtual-memory call failed; the message names the call and the code."""


class VmmUnavailable(VmmError):
    """This machine cannot do virtual memory management (no driver, no VMM support)."""


class CommitError(VmmError):
    """Backing a span failed (typically out of physical memory); nothing was left mapped."""


@dataclass(frozen=True, slots=True)
class Extension:
    """One committed span: `[address, address + size_bytes)`, backed by one handle."""

    address: int
    size_bytes: int
    handle: object


class VirtualMemory(ABC):
    """Reserve / commit / decommit / release over one device's address space.

    Contract: `reserve` returns a granularity-aligned address and costs no physical memory.
    `commit` backs `[address, address + size)` with one new extension or raises
    `CommitError` having rolled back everything it created; `commit_pieces` backs consecutive
    spans, one extension each, all or none. `decommit` returns an extension's physical memory (it
    never allocates: a device under pressure can always give back); the addresses stay reserved.
    `release` frees a reserved range; the caller must have decommitted every extension in it first.
    """

    name: str
    device: torch.device

    @property
    @abstractmethod
    def granularity_bytes(self) -> int:
        """Commit offsets and sizes must be multiples of this."""

    @abstractmethod
    def reserve(self, size_bytes: int) -> int: ...

    @abstractmethod
    def commit(self, address: int, size_bytes: int) -> Extension: ...

    @abstractmethod
    def decommit(self, extension: Extension) -> None: ...

    def decommit_many(self, extensions: list[Extension]) -> None:
        """Decommit several extensions at once (a shrink gives back hundreds): a backend may
        batch its calls; the result is that of `decommit` on each, in order."""
        for extension in extensions:
            self.decommit(extension)

    def commit_pieces(self, address: int, sizes_bytes: list[int]) -> list[Extension]:
        """Back consecutive spans from `address`, one extension per size, all or none: on any
        failure what this call made is decommitted and the error propagates."""
        made: list[Extension] = []
        try:
            for size in sizes_bytes:
                made.append(self.commit(address, size))
                address += size
        except BaseException:
            for extension in reversed(made):
                self.decommit(extension)
            raise
        return made

    @abstractmethod
    def release(self, address: int, size_bytes: int) -> None: ...

    @abstractmethod
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) physical bytes of the device this backend commits on."""

    def align_up(self, size_bytes: int) -> int:
        granule = self.granularity_bytes
        return -(-size_bytes // granule) * granule


def adjacent_spans(extensions: list[Extension]) -> list[tuple[int, int]]:
    """(address, size) of each run of extensions that follow one another in memory, in the
    order given (a run continues while the next extension starts where the last one ended)."""
    spans: list[tuple[int, int]] = []
    for extension in extensions:
        if spans and spans[-1][0] + spans[-1][1] == extension.address:
            spans[-1] = (spans[-1][0], spans[-1][1] + extension.size_bytes)
        else:
            spans.append((extension.address, extension.size_bytes))
    return spans
