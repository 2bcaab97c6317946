"""Timing GEMM candidates the way a model's step meets them, for the measured choices
(layers/fp8_gemm_choice.py, layers/dense_gemm_choice.py): weights read from HBM, not a warm L2,
candidates interleaved so that they run at the same clocks, and no host sync until the last run."""

from __future__ import annotations

from collections.abc import Callable

import torch

TIMED_RUNS, WARMUP_RUNS = 10, 3
CLOCK_WARMUP_FLUSHES = 80  # ~5 ms of HBM reads on an H200 before a key's first timed run
L2_FLUSH_BYTES = 256 << 20  # more than any GPU's L2: each timed run reads its weight from HBM


def interleaved_seconds(fns: list[Callable[[], object]]) -> list[float]:
    """Median seconds of each of `fns`, timed round-robin, each run after the L2 cache was filled
    with other (clean) lines: in a model's step the weight comes from HBM (the other layers' weights
    evicted it), so a warm-L2 time would flatter the kernels of weights that fit in L2. The flush
    reads, never writes (a dirty line left by a write would be written back during the timed
    kernel). Nothing waits for the GPU until the last run: the host enqueues faster than the ~60 us
    flush runs, so no timed kernel waits for its own launch, and the GPU stays busy throughout (an
    idle GPU drops its clocks). Round-robin gives every candidate the same clocks."""
    if not torch.cuda.is_available():  # the CPU tests stub this function; nothing to time here
        raise RuntimeError("GEMM timing needs CUDA")
    flush = torch.ones(L2_FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    for _ in range(CLOCK_WARMUP_FLUSHES):
        flush.sum()
    for fn in fns:
        for _ in range(WARMUP_RUNS):
            fn()
    events: list[list[tuple[torch.cuda.Event, torch.cuda.Event]]] = [[] for _ in fns]
    for _ in range(TIMED_RUNS):
        for fn, pairs in zip(fns, events):
            flush.sum()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
    torch.cuda.synchronize()
    return [sorted(s.elapsed_time(e) / 1e3 for s, e in pairs)[len(pairs) // 2] for pairs in events]
