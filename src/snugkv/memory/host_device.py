"""A simulated device shared by several processes: the host backend's stand-in for one GPU's memory.

A GPU's memory is one budget for every process on it, and its driver frees a process's memory when
the process dies. The host backend (`vmm_host.HostVmm`) alone has a budget per process. With
`SNUGKV_HOST_DEVICE_GIB=X` set, every host backend that joins (the engine's KV cache does) commits
against one budget of X GiB shared by all processes that set it: what each process holds is kept
per pid in a JSON file under the runtime directory, updated under an `fcntl.flock`, and the holdings
of a pid that no longer runs are dropped when the file is next read (as the driver would).
`SNUGKV_HOST_DEVICE_HEADROOM_MIB=M` makes every engine on it keep M MiB free beside its KV cache, as
a GPU engine keeps its measured activation headroom (the host's activations come from general RAM,
so it keeps none by default): what memory-pressure tests take memory below.

This module also owns the runtime directory of the host (`runtime_dir`): `$SNUGKV_RUNTIME_DIR`,
else `$XDG_RUNTIME_DIR/snugkv`, else `/dev/shm/snugkv-<uid>` (memory-backed, one per user). It never
touches device memory itself: it only keeps the books the backend consults.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snugkv.memory.vmm import GIB

RUNTIME_DIR_ENV = "SNUGKV_RUNTIME_DIR"
HOST_DEVICE_ENV = "SNUGKV_HOST_DEVICE_GIB"
HOST_HEADROOM_ENV = "SNUGKV_HOST_DEVICE_HEADROOM_MIB"


def runtime_dir() -> Path:
    """The directory this host's snugkv processes coordinate in (created, private to the user)."""
    configured = os.environ.get(RUNTIME_DIR_ENV)
    if configured:
        path = Path(configured)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "snugkv"
    elif Path("/dev/shm").is_dir():
        path = Path(f"/dev/shm/snugkv-{os.getuid()}")
    else:
        path = Path(tempfile.gettempdir()) / f"snugkv-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def process_start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot, /proc/PID/stat field 22), or None if it is gone:
    a pid and its start time name one process, even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])  # field 22 counted from the state field (3)


def is_alive(pid: int, start_ticks: int | None) -> bool:
    """Whether the process `pid` that started at `start_ticks` still runs (not a zombie)."""
    now = process_start_ticks(pid)
    if now is None or (start_ticks is not None and now != start_ticks):
        return False
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return False


@contextlib.contextmanager
def locked_json(path: Path) -> Iterator[dict]:
    """Read-modify-write of a small JSON file under an exclusive flock on `path` + ".lock"; the
    caller mutates the yielded dict, which is written back (atomically, by rename) on exit."""
    lock_path = path.with_name(path.name + ".lock")
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data = json.loads(path.read_text()) if path.exists() else {}
        except json.JSONDecodeError:
            data = {}  # a torn file cannot happen (rename); a foreign one is replaced
        before = json.dumps(data, sort_keys=True)
        yield data
        if json.dumps(data, sort_keys=True) != before:
            scratch = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            scratch.write_text(json.dumps(data, indent=1, sort_keys=True))
            scratch.replace(path)


@dataclass(frozen=True, slots=True)
class SharedHostDevice:
    """One simulated device of `capacity_bytes`, its holdings per process kept in `path`."""

    path: Path
    capacity_bytes: int
    headroom_bytes: int = 0  # what an engine keeps free beside its KV cache (SNUGKV_HOST_DEVICE_HEADROOM_MIB)

    @classmethod
    def from_env(cls) -> SharedHostDevice | None:
        """The device `SNUGKV_HOST_DEVICE_GIB` describes, or None when it is not set."""
        value = os.environ.get(HOST_DEVICE_ENV)
        if not value:
            return None
        try:
            capacity_gib = float(value)
        except ValueError:
            raise ValueError(f"{HOST_DEVICE_ENV}={value!r} is not a number of GiB") from None
        if capacity_gib <= 0:
            raise ValueError(f"{HOST_DEVICE_ENV}={value!r} must be a positive number of GiB")
        headroom = os.environ.get(HOST_HEADROOM_ENV) or "0"
        try:
            headroom_mib = float(headroom)
        except ValueError:
            raise ValueError(f"{HOST_HEADROOM_ENV}={headroom!r} is not a number of MiB") from None
        if headroom_mib < 0:
            raise ValueError(f"{HOST_HEADROOM_ENV}={headroom!r} must be 0 or more MiB")
        return cls(runtime_dir() / "host-device.json", int(capacity_gib * GIB), int(headroom_mib * 2**20))

    @contextlib.contextmanager
    def holdings(self) -> Iterator[dict[str, dict[str, Any]]]:
        """Holdings per pid (`{"bytes", "start"}`) under the lock, dead processes dropped."""
        with locked_json(self.path) as data:
            held = data.setdefault("held", {})
            for pid in [pid for pid, entry in held.items() if not is_alive(int(pid), entry.get("start"))]:
                del held[pid]
            data["capacity_bytes"] = self.capacity_bytes
            yield held

    def free_bytes(self) -> int:
        with self.holdings() as held:
            return self.capacity_bytes - sum(entry["bytes"] for entry in held.values())

    def take(self, size_bytes: int) -> int:
        """Count `size_bytes` more for this process if they fit; returns the free bytes before (the
        caller refuses the commit when that is less than `size_bytes`, and nothing is counted)."""
        with self.holdings() as held:
            free = self.capacity_bytes - sum(entry["bytes"] for entry in held.values())
            if size_bytes <= free:
                pid = str(os.getpid())
                entry = held.setdefault(pid, {"bytes": 0, "start": process_start_ticks(os.getpid())})
                entry["bytes"] += size_bytes
            return free

    def give_back(self, size_bytes: int) -> None:
        with self.holdings() as held:
            entry = held.get(str(os.getpid()))
            if entry is not None:
                entry["bytes"] = max(entry["bytes"] - size_bytes, 0)
