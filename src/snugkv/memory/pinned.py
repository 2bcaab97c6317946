"""Host memory of exactly the size asked for, page-locked on a GPU machine.

`torch.empty(n, pin_memory=True)` goes through torch's caching host allocator, which rounds every
request up to a power of two: the host KV tier's 64 GiB and one page asked for 128 GiB and failed on
a 128 GiB host (H100, 5e0943c), and 32 GiB and one page pinned 64 GiB in 34 s (be28b89); the weights'
host copy of a sleeping engine would pin 32 GB for 16. Here the memory is plain host memory, its pages
touched on torch's threads, then registered with the CUDA runtime (`cudaHostRegister`) at its own
size; the owner unregisters it before the memory goes.
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)


class HostBytes:
    """`size_bytes` of host memory as a uint8 tensor (`tensor`), page-locked while this object lives
    when `pin` (`pinned` says whether it is); `close()` (or its collection) unregisters it first.
    `touch`: fault the pages in first on torch's threads (the 64 GiB tier at start-up: 6-7 s on the
    H100 host); without, the register call faults them in itself (as the weights' copy always did).
    When the runtime refuses to lock it: RuntimeError if `required` (nothing is left held), else one
    warning line and pageable memory (copies from it are slower and wait for the host)."""

    def __init__(
        self, size_bytes: int, *, pin: bool = True, required: bool = True, touch: bool = True, what: str = ""
    ) -> None:
        self.tensor = torch.empty(size_bytes, dtype=torch.uint8)
        self.pinned = False
        if not pin or size_bytes == 0:
            return
        if touch:  # fault every page in here, on torch's threads, not inside the register call
            self.tensor.zero_()
        refused = _register(self.tensor.data_ptr(), size_bytes)
        if refused is None:
            self.pinned = True
            return
        text = f"cudaHostRegister of {size_bytes / 2**30:.2f} GiB{f' ({what})' if what else ''} failed: {refused}"
        if required:
            self.tensor = torch.empty(0, dtype=torch.uint8)
            raise RuntimeError(text)
        logger.warning("%s; copying through pageable memory", text)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = torch.empty(0, dtype=torch.uint8)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown the runtime may be gone first
            self.close()


def _register(address: int, size_bytes: int) -> str | None:
    """Page-lock the range: None when done, else what the runtime said."""
    try:
        runtime = torch.cuda.cudart()
        code = int(runtime.cudaHostRegister(address, size_bytes, 0))
    except Exception as exc:  # an old runtime, or none
        return f"{type(exc).__name__}: {exc}"
    if code == 0:
        return None
    with contextlib.suppress(Exception):
        return f"{runtime.cudaGetErrorString(runtime.cudaError(code))} ({code})"
    return f"cudaError {code}"
