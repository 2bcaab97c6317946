"""One answer to "did this fail for want of device memory?", wherever the failure came from.

A step can run out of memory in many libraries, and each says so its own way: torch raises
`torch.OutOfMemoryError`; cuBLAS and cuBLASLt report `CUBLAS_STATUS_ALLOC_FAILED` (torch passes it
on as a RuntimeError); the CUDA driver `CUDA_ERROR_OUT_OF_MEMORY` (a Triton launch, cuda-python);
the runtime `cudaErrorMemoryAllocation`; NCCL a system or CUDA error whose text says "out of
memory"; the KV arena a `CommitError`. `is_out_of_memory` recognises all of them, so the scheduler
has one path for them (retract, shrink, retry; in the end a 503 with Retry-After, never a 500).
"""

from __future__ import annotations

import torch

from snugkv.memory.vmm import CommitError

# What the libraries' messages say when an allocation failed (compared in lower case).
NO_MEMORY_MARKERS = (
    "out of memory",
    "cublas_status_alloc_failed",
    "cuda_error_out_of_memory",
    "cudaerrormemoryallocation",
    "failed to allocate",
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` (or the error it was raised from) says device memory ran out."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (torch.OutOfMemoryError, CommitError, MemoryError)):
            return True
        text = str(current).lower()
        if any(marker in text for marker in NO_MEMORY_MARKERS):
            return True
        current = current.__cause__ or current.__context__
    return False
