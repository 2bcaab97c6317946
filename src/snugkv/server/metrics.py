"""Prometheus metrics of one server: what the engine holds and how fast requests move.

The server measures what it sees on every request stream: time to first token, time per output
token, generated tokens (and a tokens/s gauge over a sliding window), prompt and cached tokens and
finished requests by finish reason. The engine reports what only it knows (KV usage, running and
queued requests, prefix-cache hit rate, the KV cache's size) as typed reports: the scheduler's
counters after each step (`update_from_stats`, a `MetricsSink`) and the client's
`metrics_snapshot()`, read at scrape time (`update_from_snapshot`).

Each `ServerMetrics` owns its own registry, so several apps in one process never collide. Nothing
here blocks or reaches the engine by itself.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from snugkv.core.reports import MetricsSnapshot, SchedulerStats

PREFIX = "snugkv"
THROUGHPUT_WINDOW_S = 10.0
# Generated tokens are counted in buckets this long, so the window holds at most
# THROUGHPUT_WINDOW_S / THROUGHPUT_BUCKET_S + 1 of them however many tokens arrive (the gauge's
# window is off by at most one bucket).
THROUGHPUT_BUCKET_S = 0.25

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.kv_cache_usage = Gauge(
            f"{PREFIX}_kv_cache_usage_ratio",
            "Fraction of KV slots held by requests (evictable prefix-cache entries not counted)",
            registry=r,
        )
        self.kv_cache_cached_usage = Gauge(
            f"{PREFIX}_kv_cache_cached_ratio",
            "Fraction of KV slots held by prefix-cache entries that admission may evict",
            registry=r,
        )
        self.running = Gauge(f"{PREFIX}_num_requests_running", "Requests the engine is running", registry=r)
        self.queued = Gauge(f"{PREFIX}_num_requests_waiting", "Requests queued in the engine", registry=r)
        self.prefix_hit_rate = Gauge(
            f"{PREFIX}_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache (fraction)",
            registry=r,
        )
        self.tokens_per_s = Gauge(
            f"{PREFIX}_generation_tokens_per_second",
            f"Generated tokens per second over the last {THROUGHPUT_WINDOW_S:.0f} s",
            registry=r,
        )
        self.kv_tokens = Gauge(
            f"{PREFIX}_kv_max_total_num_tokens", "KV cache size in tokens (changes on resize)", registry=r
        )
        self.kv_committed = Gauge(
            f"{PREFIX}_kv_committed_bytes", "Device memory backing the KV cache", registry=r
        )
        self.kv_resizes = Gauge(
            f"{PREFIX}_kv_resize_events", "KV resizes, sleeps and wakes recorded by the engine", registry=r
        )
        # Counts the engine keeps (a scrape reads them; gauges, as the engine owns the count).
        self.kv_pressure_shrinks = Gauge(
            f"{PREFIX}_kv_pressure_shrinks_total",
            "KV cache shrinks because free device memory fell below the activation headroom",
            registry=r,
        )
        self.kv_pressure_grows = Gauge(
            f"{PREFIX}_kv_pressure_grows_total", "KV cache grows after memory pressure eased", registry=r
        )
        self.oom_retries = Gauge(
            f"{PREFIX}_oom_retries_total",
            "Steps that ran out of device memory and were retried smaller (no request failed)",
            registry=r,
        )
        self.spec_draft_tokens = Gauge(
            f"{PREFIX}_spec_draft_tokens_total",
            "Speculative draft tokens the model verified (--speculative)",
            registry=r,
        )
        self.spec_accepted_tokens = Gauge(
            f"{PREFIX}_spec_accepted_tokens_total",
            "Speculative draft tokens the model accepted (--speculative)",
            registry=r,
        )
        self.spec_mean_accepted_length = Gauge(
            f"{PREFIX}_spec_mean_accepted_length",
            "Tokens a row with a draft emitted per verify step: accepted draft tokens plus one (0 before any)",
            registry=r,
        )
        self.sleep_level = Gauge(
            f"{PREFIX}_sleep_level", "0 awake; 1 or 2 asleep (vLLM's levels)", registry=r
        )
        # The prefix cache's host tier (absent without one): totals the engine keeps.
        self.prefix_hit_tokens = Gauge(
            f"{PREFIX}_prefix_cache_hit_tokens_total",
            "Prompt tokens served from the prefix cache, by the tier that held them",
            ["tier"],
            registry=r,
        )
        self.host_tier_tokens = Gauge(
            f"{PREFIX}_kv_host_tier_tokens",
            "The KV host tier: its capacity and the tokens it holds",
            ["kind"],
            registry=r,
        )
        self.host_tier_bytes_moved = Gauge(
            f"{PREFIX}_kv_host_tier_bytes_moved_total",
            "KV bytes copied between the device and the host tier",
            ["direction"],
            registry=r,
        )
        self.host_tier_copy_seconds = Gauge(
            f"{PREFIX}_kv_host_tier_copy_seconds_total",
            "Time of the copies between the device and the host tier (a GPU's: on its copy stream)",
            ["direction"],
            registry=r,
        )
        self.host_tier_dropped_tokens = Gauge(
            f"{PREFIX}_kv_host_tier_dropped_tokens_total",
            "Cached tokens that left the device with no room kept for them in the host tier",
            registry=r,
        )
        self.in_flight = Gauge(
            f"{PREFIX}_http_requests_in_flight", "Generation requests being served", registry=r
        )
        self.generated_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens", registry=r)
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.cached_prompt_tokens = Counter(
            f"{PREFIX}_cached_prompt_tokens", "Prompt tokens found in the prefix cache", registry=r
        )
        self.finished = Counter(
            f"{PREFIX}_requests_finished", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS_S, registry=r
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=TPOT_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "Request latency", buckets=E2E_BUCKETS_S, registry=r
        )
        self._lock = threading.Lock()
        # [bucket start, tokens] of the last THROUGHPUT_WINDOW_S, oldest first; pruned on every
        # write as well as every read: a server nobody scrapes must not keep one entry per delivery.
        self._recent_tokens: collections.deque[list[float]] = collections.deque()

    # What the engine reports.
    def update_from_stats(self, stats: SchedulerStats) -> None:
        self.kv_cache_usage.set(stats.kv_cache_usage)  # fraction of KV token slots requests hold, 0..1
        self.kv_cache_cached_usage.set(stats.kv_cache_cached_usage)  # held by evictable cache entries
        self.running.set(stats.num_running_requests)
        self.queued.set(stats.num_queued_requests)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)  # cached / prompt tokens, 0..1
        tier = stats.host_tier
        if tier is not None:
            self.prefix_hit_tokens.labels(tier="device").set(tier.device_hit_tokens)
            self.prefix_hit_tokens.labels(tier="host").set(tier.host_hit_tokens)
            self.host_tier_tokens.labels(kind="capacity").set(tier.capacity_tokens)
            self.host_tier_tokens.labels(kind="cached").set(tier.cached_tokens)
            self.host_tier_bytes_moved.labels(direction="to_host").set(tier.bytes_to_host)
            self.host_tier_bytes_moved.labels(direction="to_device").set(tier.bytes_to_device)
            self.host_tier_copy_seconds.labels(direction="to_host").set(tier.write_s)
            self.host_tier_copy_seconds.labels(direction="to_device").set(tier.load_s)
            self.host_tier_dropped_tokens.set(tier.dropped_tokens)
        self.spec_draft_tokens.set(stats.spec_draft_tokens)
        self.spec_accepted_tokens.set(stats.spec_accepted_tokens)
        self.spec_mean_accepted_length.set(stats.spec_mean_accepted_length)

    def update_from_snapshot(self, snapshot: MetricsSnapshot) -> None:
        self.update_from_stats(snapshot.stats)
        self.kv_tokens.set(snapshot.kv_max_total_num_tokens)  # the KV cache's size now (it may resize)
        self.kv_committed.set(snapshot.kv_committed_bytes)
        self.kv_resizes.set(snapshot.kv_resizes)  # resizes, sleeps and wakes so far
        self.sleep_level.set(snapshot.sleep_level)  # 0 awake, 1 or 2 asleep
        self.kv_pressure_shrinks.set(snapshot.kv_pressure_shrinks)
        self.kv_pressure_grows.set(snapshot.kv_pressure_grows)
        self.oom_retries.set(snapshot.oom_retries)

    # What the server measures on each request stream.
    def track(self) -> RequestTracker:
        return RequestTracker(self, started_s=time.perf_counter())

    def record_generated_tokens(self, count: int) -> None:
        if count <= 0:
            return
        self.generated_tokens.inc(count)
        now_s = time.perf_counter()
        bucket_s = now_s - now_s % THROUGHPUT_BUCKET_S
        with self._lock:
            self._forget_tokens_before(now_s - THROUGHPUT_WINDOW_S)
            if self._recent_tokens and self._recent_tokens[-1][0] == bucket_s:
                self._recent_tokens[-1][1] += count
            else:
                self._recent_tokens.append([bucket_s, count])

    def record_finished(self, reason: str, *, prompt_tokens: int, cached_tokens: int) -> None:
        self.finished.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_prompt_tokens.inc(cached_tokens)

    def recent_tokens_per_s(self) -> float:
        """Generated tokens per second over the last `THROUGHPUT_WINDOW_S`."""
        with self._lock:
            self._forget_tokens_before(time.perf_counter() - THROUGHPUT_WINDOW_S)
            recent = sum(count for _, count in self._recent_tokens)
        return recent / THROUGHPUT_WINDOW_S

    def _forget_tokens_before(self, start_s: float) -> None:
        """Drop the buckets that ended before `start_s` (the caller holds the lock)."""
        while self._recent_tokens and self._recent_tokens[0][0] + THROUGHPUT_BUCKET_S <= start_s:
            self._recent_tokens.popleft()

    def render(self) -> bytes:
        """The Prometheus text exposition, with the derived gauges brought up to date."""
        self.tokens_per_s.set(self.recent_tokens_per_s())
        return generate_latest(self.registry)


@dataclass(slots=True)
class RequestTracker:
    """Timing of one engine request (one choice), from submission to its last token."""

    metrics: ServerMetrics
    started_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None
    tokens: int = 0
    done: bool = False

    def on_tokens(self, count: int) -> None:
        if count <= 0:
            return
        now_s = time.perf_counter()
        if self.first_token_s is None:
            self.first_token_s = now_s
            self.metrics.ttft.observe(now_s - self.started_s)
        self.last_token_s = now_s
        self.tokens += count
        self.metrics.record_generated_tokens(count)

    def on_finish(self, reason: str, *, prompt_tokens: int = 0, cached_tokens: int = 0) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.record_finished(reason, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens)
        self.metrics.e2e.observe(time.perf_counter() - self.started_s)
        if self.first_token_s is not None and self.last_token_s is not None and self.tokens > 1:
            self.metrics.tpot.observe((self.last_token_s - self.first_token_s) / (self.tokens - 1))
