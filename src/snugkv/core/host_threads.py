"""torch's CPU threads in an engine that computes on a GPU.

On a GPU the engine's own CPU work is the scheduler's bookkeeping: tensors of a few thousand to a
few tens of thousands of token ids, slots and pages (`memory.allocator`, `runner.model_runner`).
torch splits an op over its OpenMP threads (one per core by default) above ~32k elements, and a
split op returns only when every thread of its team ran: when other processes keep the cores busy
(the HTTP front, a benchmark's client, another engine) one late thread holds the whole op. On the
H100 at e96c0b0 (bench peers, 64 requests of 512 prompt tokens arriving at once, torch profiler)
the admitting step's `repeat_interleave` and `index` ops took 8-42 ms each where the same ops took
~30 us elsewhere in the trace, and the GPU sat idle for 69-237 ms at a time while they ran.

`limit_for_device` gives such an engine one intra-op thread once start-up is over (loading and
converting weights may still use them all). `OMP_NUM_THREADS` set by the user keeps the user's
count; an engine on the CPU keeps every thread (its matrix products are its work).
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

GPU_ENGINE_THREADS = 1  # torch's intra-op threads for an engine whose model runs on a GPU


def limit_for_device(device: torch.device) -> int | None:
    """On a GPU, unless OMP_NUM_THREADS is set: torch's intra-op threads to GPU_ENGINE_THREADS.
    Returns the count it replaced, None when it changed nothing."""
    if device.type != "cuda" or "OMP_NUM_THREADS" in os.environ:
        return None
    before = torch.get_num_threads()
    if before <= GPU_ENGINE_THREADS:
        return None
    torch.set_num_threads(GPU_ENGINE_THREADS)
    logger.info(
        "torch's CPU ops on %d thread (was %d): the scheduler's small tensors gain nothing from more, "
        "and a split op waits for its slowest thread (set OMP_NUM_THREADS to choose)",
        GPU_ENGINE_THREADS,
        before,
    )
    return before
