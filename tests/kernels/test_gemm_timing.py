"""The GEMM choosers' timer (layers/gemm_timing.py) times the GPU's work, not the host's launches."""

from __future__ import annotations

import time

import pytest
import torch

from snugkv.layers import gemm_timing


@pytest.mark.cuda
def test_a_slow_launch_is_not_counted_as_kernel_time():
    """A candidate whose host side takes 300 us before it launches a ~µs kernel: without the spin
    that lets the host enqueue ahead, the GPU reaches the run's start event, waits for the launch
    and the event pair measures ~250 us (the flush before each run covers only ~60 us of it)."""
    x = torch.zeros(1024, device="cuda")

    def slow_launch() -> None:
        deadline = time.perf_counter() + 300e-6
        while time.perf_counter() < deadline:
            pass
        x.add_(1)

    def plain_launch() -> None:
        x.add_(1)

    slow, plain = gemm_timing.interleaved_seconds([slow_launch, plain_launch])
    assert slow < 50e-6, f"the host's 300 us counted: {slow * 1e6:.1f} us"
    assert slow < 5 * plain + 20e-6, (slow, plain)


@pytest.mark.cuda
def test_a_longer_kernel_still_times_longer():
    """The spin changes nothing the GPU does in a run: 32x the bytes reads measurably longer (8 MiB
    against 256 MiB: ~2 and ~60 us of HBM reads beside a reduction's fixed ~10 us; 16 against 128 MiB
    timed 13.6 and 39.1 us on the H200 at 55c410f)."""
    small = torch.ones(2 << 20, device="cuda")
    large = torch.ones(64 << 20, device="cuda")
    t_small, t_large = gemm_timing.interleaved_seconds([small.sum, large.sum])
    assert t_large > 3 * t_small, (t_small, t_large)
