"""torch's CPU threads once a GPU engine has started (snugkv.core.host_threads)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from snugkv.core import host_threads


@pytest.fixture
def threads() -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


def test_a_gpu_engine_runs_torchs_cpu_ops_on_one_thread(
    threads: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    caplog.set_level("INFO", logger="snugkv.core.host_threads")
    assert host_threads.limit_for_device(torch.device("cuda", 0)) == threads
    assert torch.get_num_threads() == host_threads.GPU_ENGINE_THREADS == 1
    assert "on 1 thread (was 2)" in caplog.text
    assert host_threads.limit_for_device(torch.device("cuda", 0)) is None  # already there: no new line


def test_a_cpu_engine_and_a_users_omp_num_threads_keep_their_threads(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert host_threads.limit_for_device(torch.device("cpu")) is None
    assert torch.get_num_threads() == threads
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert host_threads.limit_for_device(torch.device("cuda", 0)) is None
    assert torch.get_num_threads() == threads
