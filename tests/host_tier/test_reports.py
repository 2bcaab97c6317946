"""The host tier where operators and routers read it: /metrics (hits per tier, bytes moved each
way, copy time) and /v1/loads (cached tokens there, its hit rate)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest

from snugkv.core.reports import HostTierStats, SchedulerStats
from snugkv.server.loads import load_report
from snugkv.server.metrics import ServerMetrics

TIER = HostTierStats(
    capacity_tokens=4096,
    capacity_bytes=4096 * 1000,
    cached_tokens=1000,
    used_bytes=1000 * 1000,
    pinned=True,
    device_hit_tokens=300,
    host_hit_tokens=240,
    host_hit_rate=0.24,
    query_tokens=1000,
    spilled_tokens=1200,
    dropped_tokens=16,
    budget_dropped_tokens=8,
    bytes_to_host=1200 * 1000,
    bytes_to_device=240 * 1000,
    write_s=0.5,
    load_s=0.25,
)


def stats(tier: HostTierStats | None) -> SchedulerStats:
    return SchedulerStats(0.25, 0.5, 1, 0, 0.54, 2048, 0, 10, host_tier=tier)


def test_metrics_show_hits_per_tier_bytes_each_way_and_copy_time():
    metrics = ServerMetrics()
    metrics.update_from_stats(stats(TIER))
    text = generate_latest(metrics.registry).decode()
    for line in (
        'snugkv_prefix_cache_hit_tokens_total{tier="device"} 300.0',
        'snugkv_prefix_cache_hit_tokens_total{tier="host"} 240.0',
        'snugkv_kv_host_tier_tokens{kind="capacity"} 4096.0',
        'snugkv_kv_host_tier_tokens{kind="cached"} 1000.0',
        'snugkv_kv_host_tier_bytes_moved_total{direction="to_host"} 1.2e+06',
        'snugkv_kv_host_tier_bytes_moved_total{direction="to_device"} 240000.0',
        'snugkv_kv_host_tier_copy_seconds_total{direction="to_device"} 0.25',
        "snugkv_kv_host_tier_dropped_tokens_total 16.0",
    ):
        assert line in text, line


def test_loads_report_the_host_tiers_cached_tokens_and_hit_rate():
    metrics = ServerMetrics()
    for tier, cached, rate in ((TIER, 1000, 0.24), (None, 0, 0.0)):
        info = SimpleNamespace(
            stats=stats(tier), startup=SimpleNamespace(max_total_num_tokens=8192, max_running_requests=8)
        )
        client = SimpleNamespace(server_info=lambda info=info: info)
        entry = load_report(client, metrics)  # type: ignore[arg-type]
        assert entry["num_host_cached_tokens"] == cached and entry["host_cache_hit_rate"] == rate
        assert entry["host_tier_max_tokens"] == (4096 if tier else 0)
