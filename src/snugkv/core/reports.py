"""What an engine reports about itself: typed values the engine, the scheduler and the drivers
fill, and the server, the Python API and the memory share read.

    MemoryLedger    where the device's memory went (sizing.ledger measures it)
    StartupReport   what start-up sized: mode, `max_total_num_tokens`, the ledger, timings
    KvResize        one change of the KV cache's size: a resize, a sleep, a wake, a pressure move
    KvCacheView     the KV cache now and what a resize may ask for (the engine's view)
    KvInfo          GET /kv: the cache and what the requests in it hold
    SleepState      what sleeps now
    SchedulerStats  the scheduler's counters (KV usage, queues, prefix-cache hits)
    HostTierStats   the prefix cache's host tier: size, use, hits per tier, bytes moved
    MetricsSnapshot what /metrics reads from the engine at a scrape
    EngineInfo      GET /server_info: the engine's flags, sizing, counters and state
    MemoryReport    `LLM.memory()`: the start-up report and the KV cache's slots now

Each has `to_dict()`, the JSON the routes answer with; nobody reads a report by string keys.
Values only: nothing here measures memory or touches an engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

GIB = 1 << 30  # memory.vmm's, which this floor cannot import


@dataclass(frozen=True, slots=True)
class MemoryLedger:
    """Items counted at their source (weights from the parameters, KV from the arena's committed
    extensions, graphs and buffers from torch's allocator, the baseline from free memory before the
    engine allocated anything); `unaccounted` is what the device says is used beyond their sum."""

    device: str
    total_bytes: int
    free_bytes: int
    baseline_bytes: int  # used before the engine started: CUDA context, other processes
    weights_bytes: int
    graphs_and_buffers_bytes: int  # torch allocator minus weights: graph pool, persistent buffers
    kv_committed_bytes: int
    kv_reserved_va_bytes: int  # address space only, not memory
    activation_peak_bytes: int  # measured peak of the largest eager step
    headroom_bytes: int  # memory left free on purpose: activation peak plus the stated margin
    weights_in_device_memory: bool = True  # False on CPU (general RAM) and while the weights sleep
    graph_executables_bytes: int = 0  # driver memory taken while capturing, outside torch's allocator
    workspace_bytes: int = 0  # torch's cached blocks no tensor uses now: the activation workspace, held
    guest_room_bytes: int = 0  # left free beside the headroom for another process to start
    host_tier_bytes: int = 0  # the prefix cache's second tier, in host memory (not the device's)
    # the host tier's copy staging on the device: fixed, allocated before the KV cache was sized
    # (in torch's allocator, not counted in `graphs_and_buffers_bytes`)
    host_tier_staging_bytes: int = 0
    # speculation on: the measured peak of the largest verify step, within `activation_peak_bytes`
    verify_peak_bytes: int = 0
    # --speculative draft: its --draft-model ("" without a draft model), the measured peak of the
    # largest batch's draft steps (within `activation_peak_bytes`), and what the draft holds of its
    # own: weights (within `weights_bytes`) and KV bytes per token (within the KV cache's: a slot
    # holds both); 0 for layers:N and self, which share the model's
    draft_model: str = ""
    draft_peak_bytes: int = 0
    draft_weights_bytes: int = 0
    draft_kv_bytes_per_token: int = 0

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.free_bytes

    @property
    def accounted_bytes(self) -> int:
        weights = self.weights_bytes if self.weights_in_device_memory else 0
        return (
            self.baseline_bytes
            + weights
            + self.graphs_and_buffers_bytes
            + self.host_tier_staging_bytes
            + self.workspace_bytes
            + self.graph_executables_bytes
            + self.kv_committed_bytes
        )

    @property
    def unaccounted_bytes(self) -> int:
        return self.used_bytes - self.accounted_bytes

    def rows(self) -> list[tuple[str, int]]:
        """The device's memory, the rows above "= total" adding up to it; then figures beside it."""
        in_device = [("weights", self.weights_bytes)] if self.weights_in_device_memory else []
        beside = (
            []
            if self.weights_in_device_memory
            else [("weights (host RAM, not on the device)", self.weights_bytes)]
        )
        return [
            ("baseline (context, other processes)", self.baseline_bytes),
            *in_device,
            ("graphs and buffers (torch allocator)", self.graphs_and_buffers_bytes),
            *(
                [("KV host tier copy staging (torch allocator)", self.host_tier_staging_bytes)]
                if self.host_tier_staging_bytes
                else []
            ),
            ("activation workspace (torch cache, held)", self.workspace_bytes),
            ("graph executables and modules (driver)", self.graph_executables_bytes),
            ("KV committed", self.kv_committed_bytes),
            ("unaccounted", self.unaccounted_bytes),
            ("free", self.free_bytes),
            ("= total", self.total_bytes),
            *beside,
            ("activation peak, measured", self.activation_peak_bytes),
            *(
                [("  of which the verify step (speculation), measured", self.verify_peak_bytes)]
                if self.verify_peak_bytes
                else []
            ),
            *(
                [
                    ("  of which the draft steps (--speculative draft), measured", self.draft_peak_bytes),
                    (
                        f"draft model weights ({self.draft_model}; counted in weights)",
                        self.draft_weights_bytes,
                    ),
                ]
                if self.draft_model
                else []
            ),
            ("headroom target (peak + margin; the workspace counts toward it)", self.headroom_bytes),
            ("guest room (kept free for another process to start)", self.guest_room_bytes),
            ("KV virtual address space reserved", self.kv_reserved_va_bytes),
            *(
                [("KV host tier (host memory, beside the device)", self.host_tier_bytes)]
                if self.host_tier_bytes
                else []
            ),
        ]

    def total_rows(self) -> list[tuple[str, int]]:
        """The rows that add up to the device's total (every one above "= total")."""
        rows = self.rows()
        return rows[: [name for name, _ in rows].index("= total")]

    def table(self) -> str:
        width = max(len(name) for name, _ in self.rows())
        lines = [f"Memory ledger ({self.device}):"]
        lines += [f"  {name:<{width}}  {value / GIB:9.3f} GiB" for name, value in self.rows()]
        if self.draft_kv_bytes_per_token:  # a per-token figure, not a share of the total
            lines.append(
                f"  draft model KV per token ({self.draft_model}; in KV committed): "
                f"{self.draft_kv_bytes_per_token} bytes"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, int | str | bool]:
        data: dict[str, int | str | bool] = asdict(self)
        data.update(
            used_bytes=self.used_bytes,
            accounted_bytes=self.accounted_bytes,
            unaccounted_bytes=self.unaccounted_bytes,
        )
        return data


@dataclass(frozen=True, slots=True)
class StartupReport:
    """What start-up sized, and how long its phases took. `timings` (keys carry their unit):
    `process_age_s` (the process ran this long before the engine started: imports; Linux only),
    `device_init_s` (the CUDA context), `load_s` (weights), `reserve_s` (post-capture: the KV
    cache's virtual addresses, the runner and the dummy page), `capture_decode_s`,
    `capture_piecewise_s` and `capture_s` (both, and measuring their memory), `activation_peak_s`
    (the largest eager step, measured), `sizing_*_ms` (post-capture: measure, commit, resize;
    `sizing_ms` is the whole step) and `total_s` (the engine's start-up, the ledger included)."""

    mode: str  # a `sizing.modes.SizingMode`
    max_total_num_tokens: int
    max_running_requests: int
    ledger: MemoryLedger
    sizing_ms: float
    retries: int = 0
    per_rank_free_bytes: tuple[int, ...] = ()
    timings: dict[str, float] = field(default_factory=dict)  # keys carry their unit
    quantization: str = "none"  # the FP8 scheme the linear layers run, when they do

    def to_dict(self) -> dict[str, Any]:
        return {
            "quantization": self.quantization,
            "sizing_mode": str(self.mode),
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": self.max_running_requests,
            "sizing_ms": round(self.sizing_ms, 3),
            "retries": self.retries,
            "per_rank_free_bytes": list(self.per_rank_free_bytes),
            "memory_ledger": self.ledger.to_dict(),
            "timings": {key: round(value, 3) for key, value in self.timings.items()},
        }


PRESSURE_WHY = {
    "pressure": " (free memory fell below the activation headroom)",
    "pressure-grow": " (memory came back)",
}


@dataclass(frozen=True, slots=True)
class KvResize:
    """One change of the KV cache's size, as logged and answered."""

    reason: str  # "resize", "sleep", "wake", "pressure" (memory taken), "pressure-grow" (it came back)
    from_tokens: int
    to_tokens: int
    from_committed_bytes: int
    to_committed_bytes: int
    max_running_requests: int
    took_ms: float
    moved_pages: int = 0
    moved_window_pages: int = 0
    copied_bytes: int = 0
    evicted_tokens: int = 0
    retracted_requests: int = 0
    free_bytes: int | None = (
        None  # a pressure move: the free device memory it was sized from (MIN over ranks)
    )
    dropped_tokens: int = 0  # of evicted_tokens, those kept nowhere (the rest are in the host tier)
    room_ms: float = 0.0  # the scheduler making room before the resize (evictions and their spills)
    # a shrink first waits for the work already queued on the device (a step in flight reads the
    # pages it may unmap): not part of `took_ms`, which is the move itself
    waited_ms: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["took_ms"] = round(self.took_ms, 3)
        data["room_ms"] = round(self.room_ms, 3)
        data["waited_ms"] = round(self.waited_ms, 3)
        return data

    def log_line(self) -> str:
        moved = f", moved {self.moved_pages} pages" if self.moved_pages else ""
        if self.moved_window_pages:
            moved += f" (+{self.moved_window_pages} window pages)"
        if self.copied_bytes:
            moved += f" ({self.copied_bytes / 2**20:.1f} MiB copied)"
        evicted = f", evicted {self.evicted_tokens} cached tokens" if self.evicted_tokens else ""
        if self.evicted_tokens:
            evicted += f" ({self.dropped_tokens} dropped, {self.room_ms:.1f} ms)"
        retracted = f", retracted {self.retracted_requests} requests" if self.retracted_requests else ""
        why = PRESSURE_WHY.get(self.reason, "")
        free = f", free {self.free_bytes / GIB:.2f} GiB" if self.free_bytes is not None else ""
        waited = f" after {self.waited_ms:.1f} ms for the step in flight" if self.waited_ms >= 0.1 else ""
        return (
            f"KV {self.reason}{why}: max_total_num_tokens {self.from_tokens} -> {self.to_tokens}, committed "
            f"{self.from_committed_bytes / GIB:.2f} -> {self.to_committed_bytes / GIB:.2f} GiB{moved}{evicted}"
            f"{retracted}{free}, max_running_requests={self.max_running_requests}, took {self.took_ms:.1f} ms"
            f"{waited}"
        )


@dataclass(frozen=True, slots=True)
class KvCacheView:
    """The KV cache now and what a resize would need (rank 0's view; no collective)."""

    max_total_num_tokens: int  # committed now
    capacity_tokens: int  # what the allocator hands out
    available_tokens: int
    page_size: int
    committed_bytes: int
    reserved_bytes: int
    reserved_tokens: int
    bytes_per_token: float  # over every buffer (a window sub-pool's share included)
    chunk_bytes: int
    granularity_bytes: int
    min_tokens: int
    max_tokens: int
    max_tokens_bytes: int
    max_total_tokens: int | None  # --max-total-tokens
    max_device_memory_gib: float | None
    cap_tokens: int | None  # what --max-device-memory leaves the KV cache
    device_free_bytes: int
    headroom_bytes: int
    tokens_fitting_free_memory: int  # the headroom and the guest room kept free
    max_running_requests: int
    resizable: bool
    sleeping_tags: frozenset[str]
    events: tuple[KvResize, ...]  # the last changes, oldest first
    guest_room_bytes: int = 0  # left free for another process to start (--guest-room-mib)

    @property
    def used_tokens(self) -> int:
        return self.capacity_tokens - self.available_tokens

    @property
    def usage(self) -> float:
        return self.used_tokens / self.capacity_tokens if self.capacity_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        data.update(
            used_tokens=self.used_tokens,
            usage=self.usage,
            sleeping_tags=sorted(self.sleeping_tags),
            events=[event.to_dict() for event in self.events],
        )
        return data


@dataclass(frozen=True, slots=True)
class LargestRequest:
    rid: str
    tokens: int


@dataclass(frozen=True, slots=True)
class KvInfo:
    """GET /kv: the engine's view of the cache, plus what the requests hold and want."""

    cache: KvCacheView
    held_by_requests_tokens: int
    demand_tokens: int  # held, waiting prompts, and a page each for the next tokens
    cached_tokens: int
    evictable_cached_tokens: int
    min_tokens_without_failing_a_request: int
    largest_request: LargestRequest | None
    num_running_requests: int
    num_queued_requests: int

    def to_dict(self) -> dict[str, Any]:
        largest = self.largest_request
        return {
            **self.cache.to_dict(),
            "held_by_requests_tokens": self.held_by_requests_tokens,
            "demand_tokens": self.demand_tokens,
            "cached_tokens": self.cached_tokens,
            "evictable_cached_tokens": self.evictable_cached_tokens,
            "min_tokens_without_failing_a_request": self.min_tokens_without_failing_a_request,
            "largest_request": None if largest is None else {"rid": largest.rid, "tokens": largest.tokens},
            "num_running_requests": self.num_running_requests,
            "num_queued_requests": self.num_queued_requests,
        }


@dataclass(frozen=True, slots=True)
class SleepState:
    sleeping_tags: frozenset[str]  # what sleep released: "weights", "kv_cache", "cuda_graph"
    level: int | None  # of the sleep that released the weights: 1 kept a host copy, 2 dropped them
    weights_in_host_memory: bool
    kv_committed_bytes: int
    weights_committed_bytes: int | None  # None: the weights are not in an arena of their own

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def to_dict(self) -> dict[str, Any]:
        return {
            "is_sleeping": self.is_sleeping,
            "sleeping_tags": sorted(self.sleeping_tags),
            "level": self.level,
            "weights_in_host_memory": self.weights_in_host_memory,
            "kv_committed_bytes": self.kv_committed_bytes,
            "weights_committed_bytes": self.weights_committed_bytes,
        }


@dataclass(frozen=True, slots=True)
class KvResizeReply:
    """What POST /kv/resize answers: the change and the cache after it."""

    change: KvResize
    kv: KvInfo

    def to_dict(self) -> dict[str, Any]:
        return {**self.change.to_dict(), "kv": self.kv.to_dict()}


@dataclass(frozen=True, slots=True)
class SleepReply:
    """What POST /sleep and /wake_up answer: the change and what sleeps after it."""

    change: KvResize
    state: SleepState

    def to_dict(self) -> dict[str, Any]:
        return {**self.change.to_dict(), **self.state.to_dict()}


@dataclass(frozen=True, slots=True)
class HostTierStats:
    """The prefix cache's host tier: its size and use, the hits per tier, and what moved between
    the tiers (totals since start-up; seconds are the copies' own, on a GPU its copy stream's)."""

    capacity_tokens: int
    capacity_bytes: int
    cached_tokens: int  # tokens with a copy there (some are on the device too)
    used_bytes: int
    pinned: bool  # page-locked host memory (on a GPU); CPU tests use plain memory
    device_hit_tokens: int  # prompt tokens the prefix cache served from the device
    host_hit_tokens: int  # ... and from the host tier (loaded back before the prefill)
    host_hit_rate: float  # host_hit_tokens over the prompt tokens looked up, 0..1
    query_tokens: int  # prompt tokens looked up (a request admitted again is looked up again)
    spilled_tokens: int  # left the device into the host tier
    dropped_tokens: int  # left the device with no copy kept (the host tier had no room)
    budget_dropped_tokens: int  # of those, dropped because a pressure move's spill budget was spent
    bytes_to_host: int
    bytes_to_device: int
    write_s: float
    load_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """`kv_cache_usage` counts the slots requests hold; prefix-cache entries the next admission may
    evict are reported apart (`kv_cache_cached_usage`), so an idle engine reads 0 used."""

    kv_cache_usage: float
    kv_cache_cached_usage: float
    num_running_requests: int
    num_queued_requests: int
    prefix_cache_hit_rate: float
    prefix_cache_tokens: int
    num_retractions: int
    generated_tokens: int
    host_tier: HostTierStats | None = None  # None: no host tier
    # speculative decoding (0 while it is off): draft tokens verified, those the model kept, and
    # the rows that had a draft in a verify step (each emitted its accepted tokens plus one)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafted_rows: int = 0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a drafted row emitted per verify step (accepted + 1); 0.0 before any."""
        if not self.spec_drafted_rows:
            return 0.0
        return 1.0 + self.spec_accepted_tokens / self.spec_drafted_rows

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "spec_mean_accepted_length": self.spec_mean_accepted_length}


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """What the /metrics gauges show of the engine: its scheduler's counters and the KV cache."""

    stats: SchedulerStats
    kv_max_total_num_tokens: int  # the KV cache's size now (it may resize)
    kv_committed_bytes: int
    kv_resizes: int  # resizes, sleeps, wakes and pressure moves so far
    sleep_level: int  # 0 awake, 1 or 2 asleep
    kv_pressure_shrinks: int = 0  # shrinks because free memory fell below the activation headroom
    kv_pressure_grows: int = 0  # grows back when it returned
    oom_retries: int = 0  # steps that ran out of device memory and were retried smaller

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.stats.to_dict(),
            "kv_max_total_num_tokens": self.kv_max_total_num_tokens,
            "kv_committed_bytes": self.kv_committed_bytes,
            "kv_resizes": self.kv_resizes,
            "sleep_level": self.sleep_level,
            "kv_pressure_shrinks": self.kv_pressure_shrinks,
            "kv_pressure_grows": self.kv_pressure_grows,
            "oom_retries": self.oom_retries,
        }


@dataclass(frozen=True, slots=True)
class SlotAccounting:
    """The last check, with nothing in flight, that every slot is free or in the prefix cache."""

    checked: bool = False
    ok: bool = False
    detail: str = ""
    free_tokens: int = 0
    cached_tokens: int = 0
    capacity_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) if self.checked else {"checked": False}


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """GET /server_info: what the engine was started with and sized to, and its state now."""

    model: str
    startup: StartupReport
    page_size: int
    kv_layout: str
    kv_dtype: str
    attention_backend: str
    tp_size: int
    context_length: int
    chunked_prefill_size: int
    cuda_graph_max_bs: int  # 0: no decode graphs
    prefill_graph_max_tokens: int  # 0: no piecewise graphs
    overlap_schedule: bool
    device: str
    kv_capacity_tokens: int  # what the allocator hands out (a window model's can be below the size)
    stats: SchedulerStats
    # Counters since start: a client takes the GPU-idle fraction of a run as
    # 1 - (change in device_busy_s) / (its wall time).
    step_times: Mapping[str, float]
    step_errors: int
    gc: Mapping[str, float]  # the collector's full collections in the engine's process
    is_sleeping: bool
    kv_events: tuple[KvResize, ...]
    aborted_rids: tuple[str, ...]
    slot_accounting_when_idle: SlotAccounting
    engine_process_pid: int | None = None  # the engine runs in a process of its own
    # what the KV cache could grow to (the reserve and the caps), where it can resize; a request
    # that fits this but not `kv_capacity_tokens` waits for memory instead of being refused
    kv_max_capacity_tokens: int | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "model": self.model,
            **self.startup.to_dict(),
            "page_size": self.page_size,
            "kv_layout": self.kv_layout,
            "kv_dtype": self.kv_dtype,
            "attention_backend": self.attention_backend,
            "tp_size": self.tp_size,
            "context_length": self.context_length,
            "chunked_prefill_size": self.chunked_prefill_size,
            "cuda_graph_max_bs": self.cuda_graph_max_bs,
            "prefill_graph_max_tokens": self.prefill_graph_max_tokens,
            "overlap_schedule": self.overlap_schedule,
            "device": self.device,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "stats": self.stats.to_dict(),
            "step_times": dict(self.step_times),
            "step_errors": self.step_errors,
            "gc": dict(self.gc),
            "is_sleeping": self.is_sleeping,
            "kv_events": [event.to_dict() for event in self.kv_events],
            "aborted_rids": list(self.aborted_rids),
            "slot_accounting_when_idle": self.slot_accounting_when_idle.to_dict(),
        }
        if self.engine_process_pid is not None:
            data["engine_process"] = {"pid": self.engine_process_pid}
        if self.kv_max_capacity_tokens is not None:
            data["kv_max_capacity_tokens"] = self.kv_max_capacity_tokens
        return data


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """The start-up sizing (mode, `max_total_num_tokens`, the memory ledger, timings) and the KV
    cache's slots now."""

    sizing: StartupReport
    capacity_tokens: int  # slots the allocator hands out
    free_tokens: int
    prefix_cache_tokens: int  # slots holding cached prefixes (reusable, evicted when needed)

    @property
    def ledger(self) -> MemoryLedger:
        return self.sizing.ledger

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.sizing.to_dict(),
            "capacity_tokens": self.capacity_tokens,
            "free_tokens": self.free_tokens,
            "prefix_cache_tokens": self.prefix_cache_tokens,
        }
