"""Where one thread's wall time goes, by sampling its Python stack: `SNUGKV_SAMPLE_SCHEDULER=path`
samples the scheduler thread (engine_thread.py) and writes what it saw to `path`.

A deterministic profiler (cProfile) slows every Python call and so moves the figures it explains;
this reads the thread's current frame from another thread every `interval_s` (5 ms: a few
microseconds of GIL each time) and credits each function on the stack with the wall time since the
previous sample (the sampler needs the GIL, so while the thread computes in Python it samples less
often, every switch interval; weighting by time keeps that from hiding computation behind waits).
A function's seconds are its share of the thread's wall time, waits included (a wait in C code,
such as a CUDA event's `synchronize`, shows as the Python line that called it), which is what a
host-bound serving loop needs: the steps' host time, not its CPU time. The file is rewritten
every `write_every_s` and when sampling stops (a server that is killed leaves its last copy).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

SAMPLE_ENV = "SNUGKV_SAMPLE_SCHEDULER"
TOP = 60


def _frame_name(code_file: str, name: str, line: int) -> str:
    parts = Path(code_file).parts
    short = "/".join(parts[-2:]) if len(parts) > 1 else code_file
    return f"{short}:{name}:{line}"


class StackSampler:
    """Samples the stack of the thread `thread_id` until `stop`; `write` prints the functions by
    their seconds (inclusive: anywhere on the stack; innermost: the line the thread was on)."""

    def __init__(
        self, thread_id: int, path: str | Path, interval_s: float = 0.005, write_every_s: float = 5.0
    ):
        self.thread_id = thread_id
        self.path = Path(path)
        self.interval_s = interval_s
        self.write_every_s = write_every_s
        self.samples = 0
        self.seconds = 0.0
        self.inclusive: dict[str, float] = defaultdict(float)  # seconds
        self.innermost: dict[str, float] = defaultdict(float)
        self._last: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="snugkv-stack-sampler", daemon=True)

    @classmethod
    def from_env(cls, thread_id: int) -> StackSampler | None:
        path = os.environ.get(SAMPLE_ENV)
        return cls(thread_id, path) if path else None

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)
        self.write()

    def sample_once(self) -> None:
        now = time.monotonic()
        weight, self._last = (0.0 if self._last is None else now - self._last), now
        frame = sys._current_frames().get(self.thread_id)
        if frame is None:
            return
        self.samples += 1
        self.seconds += weight
        seen: set[str] = set()
        innermost = True
        while frame is not None:
            code = frame.f_code
            function = _frame_name(code.co_filename, code.co_name, code.co_firstlineno)
            if innermost:
                self.innermost[_frame_name(code.co_filename, code.co_name, frame.f_lineno)] += weight
                innermost = False
            if function not in seen:  # recursion counts once a sample
                seen.add(function)
                self.inclusive[function] += weight
            frame = frame.f_back

    def _run(self) -> None:
        written = time.monotonic()
        while not self._stop.wait(self.interval_s):
            self.sample_once()
            if time.monotonic() - written >= self.write_every_s:
                self.write()
                written = time.monotonic()

    def report(self, top: int = TOP) -> str:
        total = max(self.seconds, 1e-9)
        lines = [
            f"{self.samples} samples every {self.interval_s * 1e3:g} ms of thread {self.thread_id} "
            f"over {self.seconds:.1f} s"
        ]
        for title, counts in (("inclusive (function anywhere on the stack)", self.inclusive),
                              ("innermost line", self.innermost)):  # fmt: skip
            lines.append(f"\n# {title}: seconds, share")
            ranked = sorted(counts.items(), key=lambda item: -item[1])[:top]
            lines.extend(f"{seconds:9.3f} {seconds / total:6.3f}  {name}" for name, seconds in ranked)
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_suffix(self.path.suffix + ".tmp")
            temporary.write_text(self.report())
            temporary.replace(self.path)
        except OSError:
            pass  # a diagnostic: never the reason a server stops
