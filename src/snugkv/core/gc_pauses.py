"""Python's cyclic garbage collector, kept from stalling the steps.

A full collection walks every object the process tracks (torch, transformers, the model's modules,
the captured graphs' Python side: 10^5 to 10^6 objects) and holds the GIL while it does, so no
thread runs Python meanwhile: the scheduler cannot queue the next step and the GPU waits. With the
imports alone a full collection takes ~0.1 s on a CI CPU; on the H200 an engine serving through
asyncio showed single gaps of 174-236 ms between steps (bench http at 22c4a7f), where the scheduler
alone, which allocates less, showed none over 5 ms.

`freeze_startup_objects` collects once when start-up is over and moves everything still alive
into the permanent generation (`gc.freeze`): later collections walk only what serving allocates
since. `thaw` undoes it when an engine closes, so what the engine held can be collected, and at
exit, so the interpreter's last collection sees everything (bindings that count their live
objects would report the frozen ones as leaked).
`GC_PAUSES` times the full collections (through `gc.callbacks`) so the server and the benchmarks
show what the collector still costs.
"""

from __future__ import annotations

import atexit
import gc
import threading
import time
from typing import Any


class GcPauses:
    """Counts and times the collector's full (oldest-generation) collections in this process."""

    def __init__(self) -> None:
        self.full_collections = 0
        self.full_collection_s = 0.0
        self.longest_s = 0.0
        self._started: float | None = None
        self._lock = threading.Lock()
        self._installed = False
        # Counted once at each freeze: `gc.get_freeze_count()` walks the permanent generation
        # (~14 ms for ~10^6 objects on a CI CPU), too slow for every /server_info.
        self.frozen_objects = 0

    def install(self) -> None:
        """Start counting (idempotent)."""
        with self._lock:
            if not self._installed:
                gc.callbacks.append(self._on_collection)
                self._installed = True

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        pause = time.perf_counter() - self._started
        self._started = None
        self.full_collections += 1
        self.full_collection_s += pause
        self.longest_s = max(self.longest_s, pause)

    def as_dict(self) -> dict[str, Any]:
        return {
            "full_collections": self.full_collections,
            "full_collection_s": self.full_collection_s,
            "longest_full_collection_ms": self.longest_s * 1e3,
            "frozen_objects": self.frozen_objects,
        }


GC_PAUSES = GcPauses()


def freeze_startup_objects() -> None:
    """Collect what start-up left behind, then keep everything alive out of later collections."""
    GC_PAUSES.install()
    gc.collect()
    gc.freeze()
    GC_PAUSES.frozen_objects = gc.get_freeze_count()


def thaw() -> None:
    """Give the frozen objects back to the collector (an engine closed: what it held may go)."""
    gc.unfreeze()
    GC_PAUSES.frozen_objects = 0


atexit.register(thaw)  # nothing frozen: nothing to do
