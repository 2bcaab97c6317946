"""ServerMetrics: what it keeps between scrapes stays bounded, and its tokens/s gauge stays right."""

from __future__ import annotations

import pytest

from snugkv.server import metrics as metrics_module
from snugkv.server.metrics import THROUGHPUT_BUCKET_S, THROUGHPUT_WINDOW_S, ServerMetrics


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(metrics_module.time, "perf_counter", fake)
    return fake


def test_token_window_stays_bounded_when_nobody_scrapes(clock: FakeClock) -> None:
    # The soak on the H200 (no /metrics scrapes): the server's RSS grew ~3 KB a request, one entry
    # per token delivery kept for ever. 10,000 deliveries over 100 s must keep one window's buckets.
    metrics = ServerMetrics()
    for _ in range(10_000):
        metrics.record_generated_tokens(3)
        clock.now_s += 0.01
    assert len(metrics._recent_tokens) <= THROUGHPUT_WINDOW_S / THROUGHPUT_BUCKET_S + 1


def test_tokens_per_second_counts_the_last_window_only(clock: FakeClock) -> None:
    metrics = ServerMetrics()
    metrics.record_generated_tokens(10_000)  # long before the window
    clock.now_s += 3 * THROUGHPUT_WINDOW_S
    for _ in range(100):  # 20 tokens/s for the last 10 s
        metrics.record_generated_tokens(2)
        clock.now_s += 0.1
    assert metrics.recent_tokens_per_s() == pytest.approx(20.0, rel=THROUGHPUT_BUCKET_S / THROUGHPUT_WINDOW_S)
    clock.now_s += THROUGHPUT_WINDOW_S + THROUGHPUT_BUCKET_S
    assert metrics.recent_tokens_per_s() == 0.0
