"""The scheduler thread's stack sampler: a thread that sleeps in one function and computes in
another shows each by its share of the wall time, and the report reaches its file."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from snugkv.core.stack_sampler import StackSampler


def _waits(seconds: float) -> None:
    time.sleep(seconds)


def _computes(seconds: float) -> None:
    end = time.monotonic() + seconds
    total = 0
    while time.monotonic() < end:
        total += sum(range(100))


def _work(started: threading.Event) -> None:
    started.set()
    _waits(0.6)
    _computes(0.2)


def test_a_thread_sleeping_three_times_longer_than_it_computes_shows_so(tmp_path: Path) -> None:
    started = threading.Event()
    worker = threading.Thread(target=_work, args=(started,))
    worker.start()
    started.wait()
    sampler = StackSampler(worker.ident or 0, tmp_path / "scheduler.txt", interval_s=0.002).start()
    worker.join()
    sampler.stop()
    # seconds: the sampler needs the GIL, so it samples the computing thread less often
    waits = sum(seconds for name, seconds in sampler.inclusive.items() if ":_waits:" in name)
    computes = sum(seconds for name, seconds in sampler.inclusive.items() if ":_computes:" in name)
    assert sampler.samples > 50 and waits > 0 and computes > 0
    assert 2 < waits / computes < 4.5, (waits, computes)  # 0.6 s against 0.2 s, sampled
    assert 0.6 < sampler.seconds < 1.0
    text = (tmp_path / "scheduler.txt").read_text()
    assert "samples every 2 ms" in text and "_waits" in text and "innermost line" in text


def test_the_engine_thread_samples_its_scheduler_when_asked(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SNUGKV_SAMPLE_SCHEDULER", str(tmp_path / "s.txt"))
    assert StackSampler.from_env(1) is not None and StackSampler.from_env(1).path == tmp_path / "s.txt"
    monkeypatch.delenv("SNUGKV_SAMPLE_SCHEDULER")
    assert StackSampler.from_env(1) is None
