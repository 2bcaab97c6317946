"""Page-locked host memory of exactly the size asked for.

`torch.empty(n, pin_memory=True)` goes through torch's caching host allocator, which rounds every
request up to a power of two: the host KV tier's 64 GiB and one page asked for 128 GiB and failed on
a 128 GiB host (H100, 5e0943c), and 32 GiB and one page pinned 64 GiB in 34 s (be28b89). Here the
memory is plain host memory, its pages touched on torch's threads, then registered with the CUDA
runtime (`cudaHostRegister`) at its own size; the owner unregisters it before the memory goes.
"""

from __future__ import annotations

import contextlib

import torch


class PinnedHostBytes:
    """`size_bytes` of page-locked host memory as a uint8 tensor (`tensor`), registered while this
    object lives; `close()` (or its collection) unregisters it first. Raises RuntimeError (nothing
    left registered or held) when the runtime refuses."""

    def __init__(self, size_bytes: int) -> None:
        self.tensor = torch.empty(size_bytes, dtype=torch.uint8)
        self.tensor.zero_()  # fault every page in here, on torch's threads, not inside the register call
        self._address: int | None = None
        if size_bytes == 0:
            return
        code = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), size_bytes, 0))
        if code != 0:
            self.tensor = torch.empty(0, dtype=torch.uint8)
            raise RuntimeError(
                f"cudaHostRegister of {size_bytes / 2**30:.2f} GiB failed: {_error_text(code)}"
            )
        self._address = self.tensor.data_ptr()

    def close(self) -> None:
        if self._address is not None:
            torch.cuda.cudart().cudaHostUnregister(self._address)
            self._address = None
        self.tensor = torch.empty(0, dtype=torch.uint8)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown the runtime may be gone first
            self.close()


def _error_text(code: int) -> str:
    try:
        runtime = torch.cuda.cudart()
        return f"{runtime.cudaGetErrorString(runtime.cudaError(code))} ({code})"
    except Exception:
        return f"cudaError {code}"
