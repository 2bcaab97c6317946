"""Timing GEMM candidates the way a model's step meets them, for the measured choices
(layers/fp8_gemm_choice.py, layers/dense_gemm_choice.py): weights read from HBM, not a warm L2,
candidates interleaved so that they run at the same clocks, and the GPU never waiting for the host
inside a timed run."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

TIMED_RUNS, WARMUP_RUNS = 10, 3
CLOCK_WARMUP_FLUSHES = 80  # ~5 ms of HBM reads on an H200 before a key's first timed run
L2_FLUSH_BYTES = 256 << 20  # more than any GPU's L2: each timed run reads its weight from HBM
HOST_LEAD_CYCLES = 20_000_000  # ~10 ms at an H200's 1.98 GHz: the host enqueues every run meanwhile
LEAD_TRIES = 3  # each try spins 4x longer when the host still fell behind


def interleaved_seconds(fns: list[Callable[[], object]]) -> list[float]:
    """Median seconds of each of `fns`, timed round-robin, each run after the L2 cache was filled
    with other (clean) lines: in a model's step the weight comes from HBM (the other layers' weights
    evicted it), so a warm-L2 time would flatter the kernels of weights that fit in L2. The flush
    reads, never writes (a dirty line left by a write would be written back during the timed
    kernel). Round-robin gives every candidate the same clocks.

    The GPU first spins while the host enqueues every timed run: a run's events measure the GPU from
    its start event to its end event, so a GPU that caught up with the host would count the host's
    launch time (Python, a Triton launcher, a quantization launch) as the kernel's (at fa2df20, without
    the spin, the first two shapes of some batch buckets timed 2-10x slower than the same kernels at
    the neighbouring buckets). If the spin ended before the host finished enqueueing, the round is
    timed again with a longer spin."""
    if not torch.cuda.is_available():  # the CPU tests stub this function; nothing to time here
        raise RuntimeError("GEMM timing needs CUDA")
    flush = torch.ones(L2_FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    for fn in fns:
        for _ in range(WARMUP_RUNS):
            fn()
    cycles = HOST_LEAD_CYCLES
    for _ in range(LEAD_TRIES):
        seconds, host_fell_behind = _timed_round(fns, flush, cycles)
        if not host_fell_behind:
            return seconds
        cycles *= 4
    logger.info(
        "GEMM timing: the host enqueued slower than a %d-cycle spin; times may count launches", cycles // 4
    )
    return seconds


def labelled_seconds(
    runs: Mapping[str, Callable[[], object]], row: dict[str, Any], what: str
) -> dict[str, float]:
    """Median seconds of each labelled run, all timed round-robin in one `interleaved_seconds`; if
    that raises (a candidate that fails on the full batch), each alone, and a run that raises alone
    is left out and marked `"unavailable"` in `row` (`what` names the chooser in the log)."""
    try:
        return dict(zip(runs, interleaved_seconds(list(runs.values()))))
    except Exception as exc:
        logger.info("%s timing failed (%s); timing each candidate alone", what, str(exc).splitlines()[0])
    seconds: dict[str, float] = {}
    for label, run in runs.items():
        try:
            (seconds[label],) = interleaved_seconds([run])
        except Exception as exc:
            logger.info("%s %s is unavailable: %s", what, label, str(exc).splitlines()[0])
            row[label] = "unavailable"
    return seconds


def _timed_round(
    fns: list[Callable[[], object]], flush: torch.Tensor, cycles: int
) -> tuple[list[float], bool]:
    """One round of TIMED_RUNS runs of each of `fns` behind a spin of `cycles`; whether the GPU
    reached the timed runs before the host had enqueued them all."""
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    spun = torch.cuda.Event()
    spun.record()
    for _ in range(CLOCK_WARMUP_FLUSHES):  # the spin keeps one SM busy; these bring the clocks up
        flush.sum()
    events: list[list[tuple[torch.cuda.Event, torch.cuda.Event]]] = [[] for _ in fns]
    for _ in range(TIMED_RUNS):
        for fn, pairs in zip(fns, events):
            flush.sum()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
    host_fell_behind = spun.query()
    torch.cuda.synchronize()
    seconds = [sorted(s.elapsed_time(e) / 1e3 for s, e in pairs)[len(pairs) // 2] for pairs in events]
    return seconds, host_fell_behind
