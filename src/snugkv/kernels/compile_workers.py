"""Worker processes that compile Triton kernels into Triton's file cache (`snugkv.kernels.compile_worker`),
for the compile-only pass of `snugkv.kernels.compile_ahead`. Standard library only, so that an engine
process can start them first thing, before its own imports (torch, triton, the model): the workers'
imports then run beside the engine's, and they are ready when its graph capture hands them kernels.

Off unless `SNUGKV_COMPILE_AHEAD=1` (read here and nowhere else).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
from typing import Any

SWITCH_ENV = "SNUGKV_COMPILE_AHEAD"
MAX_WORKERS = 16


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "0") == "1"


class CompileWorkers:
    """Worker processes (`python -m snugkv.kernels.compile_worker`) fed jobs from one queue, a
    thread per worker writing a job and reading its answer; `wait` until all jobs are answered."""

    def __init__(self, count: int) -> None:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # they compile; a GPU they must not touch
        self.processes = [
            subprocess.Popen(
                [sys.executable, "-m", "snugkv.kernels.compile_worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
            for _ in range(count)
        ]
        self.jobs: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.answers: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._feed, args=(process,), name="snugkv-compile", daemon=True)
            for process in self.processes
        ]
        for thread in self._threads:
            thread.start()

    def _feed(self, process: subprocess.Popen[str]) -> None:
        assert process.stdin is not None and process.stdout is not None
        gone = False
        while (job := self.jobs.get()) is not None:
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
            with self._lock:
                self.answers.append({**answer, "kernel": job["name"]})
            self.jobs.task_done()
        self.jobs.task_done()

    def submit(self, job: dict[str, Any]) -> None:
        self.jobs.put(job)

    def wait(self, timeout_s: float) -> bool:
        """Whether every job was answered within `timeout_s`."""
        done = threading.Event()

        def join() -> None:
            self.jobs.join()
            done.set()

        threading.Thread(target=join, daemon=True).start()
        return done.wait(timeout_s)

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


def start(count: int | None = None) -> CompileWorkers | None:
    """Start the worker processes (switched on only; once): an engine process first thing, the
    engine as it starts on a GPU, the compile-only pass at its first kernel if none of those did."""
    global _workers
    if not enabled():
        return None
    if _workers is None:
        count = count or max(1, min(MAX_WORKERS, (os.cpu_count() or 2) - 1))  # one CPU for the engine
        _workers = CompileWorkers(count)
        atexit.register(stop)
    return _workers


def running() -> CompileWorkers | None:
    return _workers


def stop() -> None:
    global _workers
    if _workers is not None:
        _workers.close()
        _workers = None
