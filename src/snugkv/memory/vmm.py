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
    `CommitError` having rolled back everything it created. `decommit` returns an extension's
    physical memory; the addresses stay reserved. `remap` moves an extension's physical memory,
    contents and all, to another reserved span of the same size (the old span stays reserved,
    unbacked): it is how a shrink keeps the data of a partly kept extension, since a driver
    mapping can only be unmapped whole. `release` frees a reserved range; the caller must have
    decommitted every extension in it first.
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

    @abstractmethod
    def remap(self, extension: Extension, address: int) -> Extension:
        """Map `extension`'s memory at `address` instead (contents kept); returns the moved extension."""

    @abstractmethod
    def release(self, address: int, size_bytes: int) -> None: ...

    @abstractmethod
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) physical bytes of the device this backend commits on."""

    def align_up(self, size_bytes: int) -> int:
        granule = self.granularity_bytes
        return -(-size_bytes // granule) * granule
