"""What the HTTP server and the memory share need from an engine, and nothing more.

The server validates and translates requests into `GenerateInput`s, then streams `GenerateOutput`s
back; it reads the engine's state as typed reports (snugkv.core.reports) and changes its memory
through the elastic calls. It never touches pools, allocators or the model. The engine thread and
the engine process (snugkv.driver) implement `EngineClient`, and so do the server tests' fakes.

Calls that read state answer from any thread at once; the async ones run on the engine's scheduler
thread between steps (and on every tensor-parallel rank). The elastic calls raise
`sizing.resize.KvResizeError` (its `status` is the HTTP status) when the engine refuses.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Protocol

from snugkv.core.outputs import GenerateInput, GenerateOutput
from snugkv.core.profiles import ProfileReport
from snugkv.core.reports import (
    EngineInfo,
    KvInfo,
    KvResizeReply,
    MetricsSnapshot,
    SchedulerStats,
    SleepReply,
    SleepState,
)
from snugkv.core.tokenizer import Tokenizer


class EngineClient(Protocol):
    @property
    def model_name(self) -> str: ...

    @property
    def max_context_tokens(self) -> int:
        """Tokens a prompt and its output may take together (the model's context)."""
        ...

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer; None when it ships none (prompts are then token ids)."""
        ...

    # -- generating -------------------------------------------------------------------------
    def generate(self, request: GenerateInput) -> AsyncGenerator[GenerateOutput, None]:
        """Stream outputs for one request; closing the stream before its last output aborts the
        request."""
        ...

    def abort(self, rid: str) -> None: ...

    def abort_all(self) -> None:
        """End every request in flight with finish_reason "abort" (the server is stopping)."""
        ...

    # -- state ------------------------------------------------------------------------------
    def check_health(self) -> bool: ...

    def is_sleeping(self) -> bool: ...

    def server_info(self) -> EngineInfo:
        """Sizing, ledger, flags and counters (GET /server_info)."""
        ...

    def metrics_snapshot(self) -> MetricsSnapshot: ...

    def recent_steps(self) -> Sequence[tuple[object, ...]]:
        """The last steps one by one (`scheduler.launched.StepRecord` fields), oldest first."""
        ...

    def sleep_state(self) -> SleepState: ...

    # -- memory at run time (on the scheduler thread, between steps) -------------------------
    async def kv_info(self) -> KvInfo: ...

    async def resize_kv(
        self, *, max_total_num_tokens: int | None = None, free_gib: float | None = None
    ) -> KvResizeReply: ...

    async def sleep(self, *, level: int = 1, tags: tuple[str, ...] = ()) -> SleepReply: ...

    async def wake_up(self, *, tags: tuple[str, ...] = ()) -> SleepReply: ...

    # -- profiling (driver.profiling; `ProfileError` when one runs already, or none does) ---------
    async def start_profile(self, *, output_dir: str | None = None, num_steps: int | None = None) -> str:
        """Record the next steps with the torch profiler; returns the folder the trace goes to."""
        ...

    async def stop_profile(self) -> ProfileReport:
        """End the profile: its trace's path, the steps it covered, where the device time went."""
        ...

    # -- lifetime ---------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop serving and release the engine (after the requests in flight were ended)."""
        ...


class MetricsSink(Protocol):
    """Where a driver puts the scheduler's counters after each step (the server's `ServerMetrics`)."""

    def update_from_stats(self, stats: SchedulerStats) -> None: ...

    def update_from_snapshot(self, snapshot: MetricsSnapshot) -> None: ...
