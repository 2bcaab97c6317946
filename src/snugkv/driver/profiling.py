"""The torch profiler over the engine's steps, started and stopped while serving
(`POST /start_profile`, `POST /stop_profile`; `LLM.start_profile` / `stop_profile`).

It records on the thread that steps (the scheduler's): the host's ops and, on a GPU, every kernel,
for `num_steps` steps, or until stopped (at most `MAX_PROFILE_STEPS`: the profiler holds every event
in memory). Ending it stops the recording between two steps; writing the Chrome trace
(`snugkv-profile-<time>-<pid>-<n>.trace.json.gz` in the output folder: open it in Perfetto or
chrome://tracing) and reading where the device time went (`core.profiles`) run on a thread of their
own, so no step waits for them, and a failure there is the profile's (its `stop` raises it), never
a step's. With tensor parallelism only rank 0's steps are recorded.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import itertools
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import torch

from snugkv.core.profiles import ProfileError, ProfileReport, default_profile_dir, summarize_trace

logger = logging.getLogger(__name__)

MAX_PROFILE_STEPS = 10_000  # a profile ends by itself after this many steps (events stay in memory)
_traces = itertools.count()


class StepProfiler:
    """One profile at a time, over whole steps."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._profile: torch.profiler.profile | None = None
        self._directory = Path()
        self._limit = MAX_PROFILE_STEPS
        self._steps = 0
        self._started = 0.0
        self._ended: concurrent.futures.Future[ProfileReport] | None = None  # written or being written

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self, output_dir: str | Path | None = None, num_steps: int | None = None) -> str:
        """Begin recording; returns the folder the trace will go to. A report not yet taken with
        `stop` is dropped."""
        if self._profile is not None:
            raise ProfileError("a profile is already running; POST /stop_profile first")
        if num_steps is not None and not 1 <= num_steps <= MAX_PROFILE_STEPS:
            raise ProfileError(f"num_steps must be between 1 and {MAX_PROFILE_STEPS}, got {num_steps}", 400)
        directory = Path(output_dir) if output_dir else default_profile_dir()
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ProfileError(
                f"cannot write profiles to {directory}: {exc}; name another output_dir", 400
            ) from exc
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities)
        profile.start()
        self._profile, self._directory, self._limit = profile, directory, num_steps or MAX_PROFILE_STEPS
        self._steps, self._started, self._ended = 0, time.perf_counter(), None
        return str(directory)

    def on_step(self) -> None:
        """After each step: count it, and end the profile once its steps ran. Never raises."""
        if self._profile is None:
            return
        self._steps += 1
        if self._steps >= self._limit:
            self._end()

    def stop(self) -> concurrent.futures.Future[ProfileReport]:
        """End the running profile, or take the one that ended at its step count: its report, once
        its trace is written (`ProfileError` if that failed). A second `stop` has none to take."""
        if self._profile is not None:
            self._end()
        ended, self._ended = self._ended, None
        if ended is None:
            raise ProfileError("no profile is running; POST /start_profile first")
        return ended

    def _end(self) -> None:
        """Stop recording (between two steps, on the stepping thread); write and read the trace on a
        thread of its own."""
        profile, self._profile = self._profile, None
        assert profile is not None
        ended: concurrent.futures.Future[ProfileReport] = concurrent.futures.Future()
        self._ended = ended
        steps, seconds = self._steps, time.perf_counter() - self._started
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            profile.stop()
        except Exception as exc:  # the profile fails, not the step
            logger.exception("stopping the profiler failed")
            ended.set_exception(ProfileError(f"the profiler failed to stop: {exc}", 500))
            return
        name = f"snugkv-profile-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{next(_traces)}.trace.json"
        thread = threading.Thread(
            target=_write_trace,
            args=(profile, self._directory / name, steps, seconds, ended),
            name="snugkv-profile-write",
            daemon=True,
        )
        thread.start()


def _write_trace(
    profile: torch.profiler.profile,
    plain: Path,
    steps: int,
    seconds: float,
    ended: concurrent.futures.Future[ProfileReport],
) -> None:
    try:
        profile.export_chrome_trace(str(plain))
        path = plain.with_name(plain.name + ".gz")
        with open(plain, "rb") as source, gzip.open(path, "wb") as target:
            shutil.copyfileobj(source, target)
        plain.unlink()
        ended.set_result(ProfileReport(str(path), steps, seconds, summarize_trace(path)))
    except Exception as exc:
        logger.exception("writing the profile's trace to %s failed", plain.parent)
        ended.set_exception(ProfileError(f"writing the trace to {plain.parent} failed: {exc}", 500))
