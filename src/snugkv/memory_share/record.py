"""The per-device coordination record of elastic engines (`snugkv serve --kv-elastic`).

Several engines on one GPU coordinate through one small JSON file per device under the host's
runtime directory (`memory.host_device.runtime_dir`), read and written under an `fcntl.flock`: no
server, no shared memory segment, nothing to clean up by hand. Each engine owns one entry, keyed
by its pid, and rewrites only that entry: its state (starting, running, sleeping), its KV cache
now (bytes and tokens), its demand (tokens in use plus waiting, in bytes), its minimum and maximum,
its activation headroom, its weight (`--memory-share`), what it asks the others to free while it
starts, and a heartbeat. An entry whose process is gone (its pid no longer runs, or runs another
program: the pid's start time is kept) is stale and is cleared by whoever reads the record next.

Devices are keyed so that every process names a GPU alike whatever its CUDA_VISIBLE_DEVICES: by
the GPU's UUID, or `host` for the host backend's shared simulated device. What an engine does with
the record is the policy's (`memory_share.policy`) and each engine's share (`memory_share.share`).
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from snugkv.memory.host_device import is_alive, locked_json, process_start_ticks, runtime_dir

logger = logging.getLogger(__name__)

STARTING, RUNNING, SLEEPING = "starting", "running", "sleeping"


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
