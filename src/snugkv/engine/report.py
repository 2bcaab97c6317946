"""What start-up leaves behind: the sized KV cache of a sizing mode and the engine's report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from snugkv.memory.kv_pool import KVPool
from snugkv.runner.model_runner import ModelRunner
from snugkv.sizing.ledger import MemoryLedger
from snugkv.sizing.modes import SizingMode


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


@dataclass(frozen=True, slots=True)
class StartupReport:
    mode: SizingMode
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
