"""Worker processes that compile Triton kernels into Triton's file cache (`snugkv.kernels.compile_worker`),
for the compile-only pass of `snugkv.kernels.compile_ahead`. Standard library only, so that an engine
process can start them first thing, before its own imports (torch, triton, the model): the workers'
imports then run beside the engine's, and they are ready when its graph capture hands them kernels.

`SNUGKV_COMPILE_AHEAD` (read here and nowhere else): `1` on, `0` off; unset (`auto`), on for a
start that will compile its kernels, one on a machine with an NVIDIA GPU whose Triton cache is
empty or missing (a fresh machine: the 8B shape's cold start 21.6 -> 12.2 s on the H100 at
8d210d0, docs/bench/startup.md), and off where the cache holds kernels already: there the workers'
own imports would slow a start whose kernels load from the cache. Decided once per process, for its
first engine start only.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterable
from typing import Any

SWITCH_ENV = "SNUGKV_COMPILE_AHEAD"
MAX_WORKERS = 16


_decided: bool | None = None
_ON, _OFF = {"1", "on", "true", "yes"}, {"0", "off", "false", "no"}


def _switch() -> str:
    """`SNUGKV_COMPILE_AHEAD` as "on", "off" or "auto" (unset; any other value, with a warning)."""
    value = os.environ.get(SWITCH_ENV, "auto").strip().lower()
    if value in _ON or value in _OFF or value == "auto":
        return "on" if value in _ON else "off" if value in _OFF else "auto"
    logging.getLogger(__name__).warning("%s=%r is not 0, 1 or auto: taken as auto", SWITCH_ENV, value)
    return "auto"


def enabled() -> bool:
    """Whether this process compiles its Triton kernels ahead (see the module's docstring)."""
    global _decided
    if _decided is None:
        switch = _switch()
        if switch == "auto":  # this process's first start only (`stop` turns it off for the rest)
            cold = has_nvidia_gpu() and not any_entries(triton_cache_dir())
            switch = "on" if cold and os.environ.get("TRITON_INTERPRET") != "1" else "off"
        _decided = switch == "on"
    return _decided


def has_nvidia_gpu() -> bool:
    """An NVIDIA driver's device node, without importing torch (an engine process asks first thing)."""
    return os.path.exists("/dev/nvidiactl")


def triton_cache_dir() -> str:
    """Where Triton keeps compiled kernels: `TRITON_CACHE_DIR`, else `$TRITON_HOME/.triton/cache`
    (home: the user's)."""
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache")


def any_entries(path: str) -> bool:
    try:
        with os.scandir(path) as entries:
            return any(True for _ in entries)
    except OSError:  # missing
        return False


def forget_decision() -> None:
    """For tests: decide again at the next `enabled()`."""
    global _decided
    _decided = None


class CompileWorkers:
    """Worker processes (`python -m snugkv.kernels.compile_worker`) fed jobs from one queue, first
    in first out, a thread per worker writing a job and reading its answer. A job submitted again
    (the same kernel, specialization and target) is the first one; `wait` for some jobs or all."""

    def __init__(self, count: int) -> None:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # they compile; a GPU they must not touch
        self.processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "snugkv.kernels.compile_worker",
                    *(["--driver-utils"] if index == 0 else []),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
            for index in range(count)
        ]
        self.jobs: queue.Queue[tuple[int, dict[str, Any]] | None] = queue.Queue()
        self.answers: list[dict[str, Any]] = []  # in the order they came, each with its job's `id`
        self._ids: dict[str, int] = {}  # a job (as JSON) -> its id
        self._answered: set[int] = set()
        self._changed = threading.Condition()
        self._threads = [
            threading.Thread(target=self._feed, args=(process,), name="snugkv-compile", daemon=True)
            for process in self.processes
        ]
        for thread in self._threads:
            thread.start()

    def _feed(self, process: subprocess.Popen[str]) -> None:
        assert process.stdin is not None and process.stdout is not None
        gone = False
        while (item := self.jobs.get()) is not None:
            job_id, job = item
            answer: dict[str, Any] = {"ok": False, "error": "its worker exited"}
            if not gone:  # a worker that exited answers what it takes at once: the warm-up compiles it
                try:
                    process.stdin.write(json.dumps(job) + "\n")
                    process.stdin.flush()
                    line = process.stdout.readline()
                    gone = not line
                    answer = json.loads(line) if line else answer
                except (OSError, ValueError) as exc:
                    gone, answer = True, {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            with self._changed:
                self.answers.append({**answer, "kernel": job["name"], "id": job_id})
                self._answered.add(job_id)
                self._changed.notify_all()

    def submit(self, job: dict[str, Any]) -> int:
        """Queue `job`; its id (an earlier job's, if it was submitted before)."""
        key = json.dumps(job, sort_keys=True)
        with self._changed:
            if key in self._ids:
                return self._ids[key]
            job_id = self._ids[key] = len(self._ids)
        self.jobs.put((job_id, job))
        return job_id

    def wait(self, timeout_s: float, ids: Iterable[int] | None = None) -> bool:
        """Whether the jobs `ids` (None: every job submitted) were answered within `timeout_s`."""
        with self._changed:
            wanted = set(self._ids.values()) if ids is None else set(ids)
            return self._changed.wait_for(lambda: wanted <= self._answered, timeout_s)

    def close(self) -> None:
        """End the workers at once: what they compiled is in Triton's cache, written whole (a
        wait for each one's exit cost 4.7 s of an 8B start on the H100 at 3a4ac76)."""
        for _ in self._threads:
            self.jobs.put(None)
        for process in self.processes:
            with contextlib.suppress(OSError):
                process.kill()
        for process in self.processes:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                process.wait(timeout=5)


_workers: CompileWorkers | None = None


def start(count: int | None = None, ranks: int = 1) -> CompileWorkers | None:
    """Start the worker processes (switched on only; once): an engine process first thing, the
    engine as it starts on a GPU, the compile-only pass at its first kernel if none of those did.
    `ranks`: engines of one tensor-parallel group on this machine, which share its CPUs."""
    global _workers
    if not enabled():
        return None
    if _workers is None:
        count = count or max(1, min(MAX_WORKERS, ((os.cpu_count() or 2) - ranks) // ranks))  # a CPU a rank
        _workers = CompileWorkers(count)
        atexit.unregister(stop)  # once, however many starts
        atexit.register(stop)
    return _workers


def running() -> CompileWorkers | None:
    return _workers


def stop() -> None:
    """End the workers; unless switched on by name, later starts in this process compile as before
    (their kernels are mostly in this process's memory already)."""
    global _workers, _decided
    if _workers is not None:
        _workers.close()
        _workers = None
    if _switch() != "on":
        _decided = False
