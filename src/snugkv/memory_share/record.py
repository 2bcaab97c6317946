"""The per-device coordination record of elastic engines (`snugkv serve --kv-elastic`).

Several engines on one GPU coordinate through one small JSON file per device under the host's
runtime directory (`memory.host_device.runtime_dir`), read and written under an `fcntl.flock`: no
server, no shared memory segment, nothing to clean up by hand. Each engine owns one entry, keyed
by its pid, and rewrites only that entry: its state (starting, running, sleeping), its KV cache
now (bytes and tokens), its demand (tokens in use plus waiting, in bytes), its minimum and maximum,
its activation headroom, its weight (`--memory-share`), what it asks the others to free while it
starts, where it is in its start-up (`start_phase`), and a heartbeat. An entry whose process is gone (its pid no longer runs, or runs another
program: the pid's start time is kept) is stale and is cleared by whoever reads the record next.

Engines that start together also keep one record-wide document beside the entries: the start plan
(`StartPlan`), the KV bytes each of them commits at its sizing point, written once by whichever of
them finds the cohort ready (`memory_share.start` says when) and read by the others.

Devices are keyed so that every process names a GPU alike whatever its CUDA_VISIBLE_DEVICES: by
the GPU's UUID, or `host` for the host backend's shared simulated device. What an engine does with
the record is the policy's (`memory_share.policy`) and each engine's share (`memory_share.share`).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from snugkv.memory.host_device import is_alive, locked_json, process_start_ticks, runtime_dir

logger = logging.getLogger(__name__)

STARTING, RUNNING, SLEEPING = "starting", "running", "sleeping"
# Where a starting engine is in its start-up (`EngineEntry.start_phase`; "" outside one, and for a
# wake's ask): registered and loading (the engines loading together form a cohort); registered while
# another engine was sizing, so waiting for it to run (not part of its cohort); at its sizing point
# with free memory measured, waiting for the cohort's plan; sized (its KV committed or committing).
LOADING, LATE, SIZING, SIZED = "loading", "late", "sizing", "sized"


@dataclass(frozen=True, slots=True)
class EngineEntry:
    """One engine's line in the record (all sizes in bytes of device memory)."""

    pid: int
    start_ticks: int | None
    name: str
    url: str
    state: str
    weight: float
    kv_bytes: int = 0
    kv_tokens: int = 0
    bytes_per_token: int = 0
    min_kv_bytes: int = 0
    max_kv_bytes: int = 0
    demand_bytes: int = 0
    headroom_bytes: int = 0
    cached_bytes: int = 0  # torch's cached, unused blocks: part of its headroom, not free to the others
    start_room_bytes: int = 0  # kept free so that a new engine can make its CUDA context and ask
    need_bytes: int = 0  # while starting: what it asks the others to leave free
    granted: bool = False  # while starting: the ask was met; it loads (the others give no more)
    start_phase: str = ""  # LOADING, LATE, SIZING, SIZED while it starts; "" otherwise
    sizing_free_bytes: int = 0  # at its sizing point: device free memory, the starters' holds added back
    held_bytes: int = 0  # while starting: what it holds allocated for the running engines' headroom
    resized_at: float = 0.0  # wall clock of its last resize (the others wait a moment after one)
    resizing: bool = False  # a resize is in flight (the others hold still until it is published)
    heartbeat: float = 0.0

    @classmethod
    def of_this_process(cls, name: str, weight: float, **values: Any) -> EngineEntry:
        pid = os.getpid()
        return cls(pid, process_start_ticks(pid), name, "", STARTING, weight, heartbeat=time.time(), **values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineEntry:
        known = {field.name for field in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})

    def beat(self, **changes: Any) -> EngineEntry:
        return replace(self, heartbeat=time.time(), **changes)


@dataclass(frozen=True, slots=True)
class StartPlan:
    """What the engines that started together commit at their sizing points: KV bytes by pid, and
    the figures the split was made from (for the log and for people)."""

    grants: dict[int, int]
    free_bytes: int
    reserve_bytes: int
    pending: tuple[int, ...] = ()  # members not at their sizing point yet when it was made
    made_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "grants": {str(pid): value for pid, value in self.grants.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StartPlan:
        return cls(
            grants={int(pid): int(value) for pid, value in data["grants"].items()},
            free_bytes=int(data["free_bytes"]),
            reserve_bytes=int(data["reserve_bytes"]),
            pending=tuple(int(pid) for pid in data.get("pending", ())),
            made_at=float(data.get("made_at", 0.0)),
        )

    def still_needed(self, entries: Sequence[EngineEntry]) -> bool:
        """Whether a member has still to commit its grant (is still loading or at its sizing point)."""
        return any(
            e.pid in self.grants and e.state == STARTING and e.start_phase in (LOADING, SIZING)
            for e in entries
        )


def device_key(device: torch.device) -> str:
    """The record's name for `device`: the GPU's UUID (the same in every process), or `host`."""
    if device.type != "cuda":
        return "host"
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"gpu-{uuid}" if uuid is not None else f"cuda{index}"


class ShareRecord:
    """The record of one device: `publish` this engine's entry, read everyone's, clear stale ones."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def for_device(cls, key: str) -> ShareRecord:
        return cls(runtime_dir() / f"engines-{re.sub(r'[^A-Za-z0-9_.-]', '_', key)}.json")

    def publish(self, entry: EngineEntry) -> list[EngineEntry]:
        """Write `entry` (replacing this pid's) and return every live entry, it included."""
        with locked_json(self.path) as data:
            engines = self._live(data)
            engines[str(entry.pid)] = entry.to_dict()
            return [EngineEntry.from_dict(value) for value in engines.values()]

    def publish_with(
        self, make: Callable[[list[EngineEntry], StartPlan | None], EngineEntry]
    ) -> tuple[EngineEntry, list[EngineEntry]]:
        """Write the entry `make` returns from every live entry and the live start plan, both read
        under the same lock (a choice no other engine can slip between); returns it and every live
        entry, it included."""
        with locked_json(self.path) as data:
            engines = self._live(data)
            before = [EngineEntry.from_dict(value) for value in engines.values()]
            entry = make(before, self._live_plan(data, before))
            engines[str(entry.pid)] = entry.to_dict()
            return entry, [EngineEntry.from_dict(value) for value in engines.values()]

    def agree_start(
        self, entry: EngineEntry, plan_for: Callable[[list[EngineEntry], StartPlan | None], StartPlan | None]
    ) -> tuple[list[EngineEntry], StartPlan | None]:
        """Publish `entry`; then, under the same lock, the live start plan if it covers `entry`, else
        the one `plan_for(entries, live plan)` makes (stored for the others), else None."""
        with locked_json(self.path) as data:
            engines = self._live(data)
            engines[str(entry.pid)] = entry.to_dict()
            entries = [EngineEntry.from_dict(value) for value in engines.values()]
            plan = self._live_plan(data, entries)
            if plan is not None and entry.pid in plan.grants:
                return entries, plan
            made = plan_for(entries, plan)
            if made is not None:
                data["start_plan"] = made.to_dict()
            return entries, made

    def start_plan(self) -> StartPlan | None:
        """The live start plan, if any (for people: `snugkv memory --gpu`, `GET /kv/engines`)."""
        with locked_json(self.path) as data:
            return self._live_plan(
                data, [EngineEntry.from_dict(value) for value in self._live(data).values()]
            )

    @staticmethod
    def _live_plan(data: dict[str, Any], entries: Sequence[EngineEntry]) -> StartPlan | None:
        """The stored start plan while a member still needs it; a spent one is dropped."""
        stored = data.get("start_plan")
        if stored is None:
            return None
        plan = StartPlan.from_dict(stored)
        if plan.still_needed(entries):
            return plan
        del data["start_plan"]
        return None

    def remove(self, pid: int) -> None:
        with locked_json(self.path) as data:
            self._live(data).pop(str(pid), None)

    def entries(self) -> list[EngineEntry]:
        """Every live entry (stale ones are cleared on the way)."""
        with locked_json(self.path) as data:
            return [EngineEntry.from_dict(value) for value in self._live(data).values()]

    def _live(self, data: dict[str, Any]) -> dict[str, Any]:
        engines: dict[str, Any] = data.setdefault("engines", {})
        for pid, value in list(engines.items()):
            if not is_alive(int(pid), value.get("start_ticks")):
                del engines[pid]
                logger.warning(
                    "Cleared the stale entry of engine pid %s (%s, held %.2f GiB of KV): its process is gone",
                    pid,
                    value.get("name", "?"),
                    value.get("kv_bytes", 0) / 2**30,
                )
        return engines
