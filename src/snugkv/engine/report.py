"""What a sizing mode leaves behind at start-up: the runner over its sized pool and the figures the
report (`core.reports.StartupReport`) and the ledger show."""

from __future__ import annotations

from dataclasses import dataclass, field

from snugkv.memory.kv_pool import KVPool
from snugkv.runner.model_runner import ModelRunner


@dataclass(frozen=True, slots=True)
class SizedKV:
    """What a sizing mode leaves behind: the runner over its sized pool, and the figures the
    report and the ledger show."""

    runner: ModelRunner
    max_total_num_tokens: int
    max_running_requests: int
    sizing_ms: float
    activation_peak_bytes: int
    headroom_bytes: int
    graph_driver_bytes: int
    retries: int = 0
    per_rank_free_bytes: tuple[int, ...] = ()
    timings: dict[str, float] = field(default_factory=dict)  # keys carry their unit

    @property
    def pool(self) -> KVPool:
        return self.runner.kv_pool
