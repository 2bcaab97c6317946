"""The torch profiler over the engine's steps, started and stopped while serving
(`POST /start_profile`, `POST /stop_profile`; `LLM.start_profile` / `stop_profile`).

It runs on the thread that steps (the scheduler's), records the host's ops and, on a GPU, every
kernel, for `num_steps` steps or until stopped, then writes one Chrome trace
(`snugkv-profile-<time>.trace.json.gz` in the output directory: open it in Perfetto or
chrome://tracing) and answers where the device time went, by kind of kernel
(`core.profiles`). With tensor parallelism only rank 0's steps are recorded.
"""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from snugkv.core.profiles import ProfileError, ProfileReport, summarize_trace

PROFILE_DIR_ENV = "SNUGKV_PROFILE_DIR"  # where traces go when the request names no directory
MAX_PROFILE_STEPS = 10_000


def default_profile_dir() -> Path:
    return Path(os.environ.get(PROFILE_DIR_ENV) or Path(tempfile.gettempdir()) / "snugkv-profile")


class StepProfiler:
    """One profile at a time, over whole steps."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._profile: torch.profiler.profile | None = None
        self._directory = Path()
        self._num_steps: int | None = None
        self._steps = 0
        self._started = 0.0
        self.last: ProfileReport | None = None  # the report of the profile that ended last

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self, output_dir: str | None = None, num_steps: int | None = None) -> str:
        """Begin recording; returns the directory the trace will go to."""
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
        self._profile, self._directory, self._num_steps = profile, directory, num_steps
        self._steps, self._started, self.last = 0, time.perf_counter(), None
        return str(directory)

    def on_step(self) -> None:
        """After each step: count it, and stop once `num_steps` ran."""
        if self._profile is None:
            return
        self._steps += 1
        if self._num_steps is not None and self._steps >= self._num_steps:
            self.stop()

    def stop(self) -> ProfileReport:
        """End the running profile, write its trace, and summarize it; after a profile that ended
        at its `num_steps`, the report of that one."""
        profile = self._profile
        if profile is None:
            if self.last is not None:
                return self.last
            raise ProfileError("no profile is running; POST /start_profile first")
        self._profile = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        profile.stop()
        seconds = time.perf_counter() - self._started
        stamp = time.strftime("%Y%m%d-%H%M%S")
        plain = self._directory / f"snugkv-profile-{stamp}-{os.getpid()}.trace.json"
        profile.export_chrome_trace(str(plain))
        path = plain.with_name(plain.name + ".gz")
        with open(plain, "rb") as source, gzip.open(path, "wb") as target:
            shutil.copyfileobj(source, target)
        plain.unlink()
        self.last = ProfileReport(str(path), self._steps, seconds, summarize_trace(path))
        return self.last
