"""Host memory of its exact size (snugkv.memory.pinned): plain on request, and where the runtime
cannot page-lock it (this CPU build has no CUDA runtime), an error when required, else pageable
memory and one warning line. The page-locked path runs on the device
(tests/host_tier/test_stream_copies_cuda.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from snugkv.memory.pinned import HostBytes


def test_unpinned_host_bytes_are_exactly_the_size_asked() -> None:
    host = HostBytes(3 * 4096 + 5, pin=False)
    assert host.tensor.numel() == 3 * 4096 + 5 and host.tensor.dtype == torch.uint8 and not host.pinned
    host.close()
    assert host.tensor.numel() == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a runtime that refuses to page-lock")
def test_a_refused_page_lock_raises_when_required_and_falls_back_with_one_warning_otherwise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of .* \(the test's\) failed"):
        HostBytes(8192, what="the test's")
    caplog.set_level(logging.WARNING, logger="snugkv.memory.pinned")
    host = HostBytes(8192, required=False, what="the test's")
    assert not host.pinned and host.tensor.numel() == 8192
    assert [r.getMessage().endswith("copying through pageable memory") for r in caplog.records] == [True]
