"""A step on its way: scheduled by the host, queued on the device, its results read later.

`ScheduledBatch` is one step's work (rows, their requests, their slots). Once its forward and
sampling are queued it becomes a `LaunchedStep`: the sampled tokens (and log-probabilities, for
the rows that asked) are being copied to pinned host memory, and an event recorded after the
copies says when they arrived. `results()` waits on that event only, not on the work queued
after it, so the host can queue step N+1 before it reads step N's tokens.

`StepTimes` adds up how long the device was busy with the steps: on a GPU from events recorded
as each step's forward is called and after its copies (the stream runs steps one after another,
so these spans never overlap and a gap between them is time the GPU waited for the host; a span
also holds the host's building of the batch, a fraction of a millisecond, so it overstates the
busy time a little when the GPU waits); on a CPU, where the forward is synchronous, from the host
clock around the same calls. It also adds up how long the host waited for results: near zero
means the host is the bottleneck. The last few thousand steps are kept as `StepRecord`s: when each
was launched (host monotonic clock), its kind and size, and the device's idle gap before it, which
is what places an idle GPU in time (before a prefill, between decode steps, at a run's start).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from snugkv.core.forward import BatchRow
from snugkv.scheduler.prompt_scores import PromptScores
from snugkv.scheduler.request import Request


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """One step's work: a row per request (in `requests` order) and the slots of their new tokens.
    `drafts`: a speculative decode step's draft per row (empty for a row without one), whose
    tokens are verified instead of sampled; None for every other step. A draft model's drafts are
    placeholders until the launch runs its forwards and writes them (and the rows' tokens) in place."""

    rows: list[BatchRow]
    requests: list[Request]
    slots: torch.Tensor
    decode: bool
    drafts: list[list[int]] | None = None
    decode_rows: int = 0  # a mixed prefill step: its leading rows are running requests' decode rows


def clock(device: torch.device) -> Any:
    """A point in the device's work: a CUDA event recorded on the stream, or the host clock on a CPU."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


@dataclass(slots=True)
class LaunchedStep:
    batch: ScheduledBatch
    sampled_rows: list[int]  # indices into batch.rows of the rows whose token was sampled
    tokens: torch.Tensor | None  # host-bound copy, `[len(sampled_rows)]`
    log_probs: torch.Tensor | None  # host-bound copy of OutputBuilder.log_prob_rows
    started: Any  # a CUDA event or a perf_counter reading
    launched_at: float = field(default_factory=time.monotonic)  # host clock, as the forward was queued
    prompt_scores: PromptScores | None = None  # host-bound log-probabilities of prompt tokens
    done: Any = None
    overlapped: bool = False  # queued while the step before it was still unread
    waited_s: float = 0.0  # how long `results` waited for the device
    host_tokens: list[int] | None = None  # the tokens, once read
    # a verify step's host-bound copy, `[rows, 1 + max k + 1]`: each row's accepted length, then the
    # accepted draft tokens, the one drawn after them, and -1 padding (`tokens` is None then)
    verified: torch.Tensor | None = None

    def finish_launch(self, device: torch.device) -> None:
        """Mark the end of what this step queued (after the copies to the host)."""
        self.done = clock(device)

    def running(self) -> bool:
        """Whether the device is still working on this step (host work now hides behind it); never
        on a CPU, whose steps are done when launched."""
        return isinstance(self.done, torch.cuda.Event) and not self.done.query()

    def results(self) -> tuple[list[int], torch.Tensor | None]:
        """The sampled tokens (in `sampled_rows` order) and the log-probability rows, once on the host."""
        if self.host_tokens is None:
            if isinstance(self.done, torch.cuda.Event):
                started = time.perf_counter()
                self.done.synchronize()
                self.waited_s = time.perf_counter() - started
            self.host_tokens = self.tokens.tolist() if self.tokens is not None else []
        return self.host_tokens, self.log_probs

    def emitted(self) -> list[list[int]]:
        """A verify step's tokens per row, once on the host: the accepted draft tokens and the
        one drawn after them (1 to k + 1 each)."""
        self.results()
        if self.verified is None:
            raise RuntimeError("not a verify step: its tokens are read with results()")
        return [row[1 : 2 + row[0]] for row in self.verified.tolist()]

    def busy_s(self) -> float:
        """Device time from just before the forward to the end of the copies (after `results`)."""
        return _between(self.started, self.done)


class StepRecord(NamedTuple):
    """One step whose results the host read: `gap_s` is how long the device sat idle between the
    step before (its copies done) and this one's forward (None for the first step after a reset)."""

    launched_at: float  # time.monotonic() as its forward was queued
    decode: bool
    rows: int
    tokens: int
    busy_s: float
    gap_s: float | None
    waited_s: float


@dataclass(slots=True)
class StepTimes:
    """Counts of the steps whose results the host read, the device time they took, and the last
    `RECORDS` steps one by one."""

    RECORDS = 8192

    steps: int = 0
    overlapped_steps: int = 0
    device_busy_s: float = 0.0
    host_wait_s: float = 0.0
    started_s: float = field(default_factory=time.perf_counter)
    records: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=StepTimes.RECORDS))
    _previous_done: Any = field(default=None, init=False, repr=False)

    def add(self, step: LaunchedStep) -> None:
        busy = step.busy_s()
        self.steps += 1
        self.overlapped_steps += step.overlapped
        self.device_busy_s += busy
        self.host_wait_s += step.waited_s
        gap = None if self._previous_done is None else _between(self._previous_done, step.started)
        self._previous_done = step.done
        batch = step.batch
        tokens = int(batch.slots.shape[0])  # a slot per new token
        self.records.append(
            StepRecord(step.launched_at, batch.decode, len(batch.rows), tokens, busy, gap, step.waited_s)
        )

    def reset(self) -> None:
        self.steps = self.overlapped_steps = 0
        self.device_busy_s = self.host_wait_s = 0.0
        self.started_s = time.perf_counter()
        self.records.clear()
        self._previous_done = None

    def as_dict(self, wall_s: float | None = None) -> dict[str, Any]:
        """The counts, and the device-idle fraction over `wall_s` (default: since the last reset)."""
        wall_s = time.perf_counter() - self.started_s if wall_s is None else wall_s
        return {
            "steps": self.steps,
            "overlapped_steps": self.overlapped_steps,
            "device_busy_s": self.device_busy_s,
            "host_wait_s": self.host_wait_s,
            "device_idle_fraction": max(0.0, 1 - self.device_busy_s / wall_s) if wall_s > 0 else 0.0,
        }


def _between(earlier: Any, later: Any) -> float:
    """Seconds from one `clock` point to a later one (never below zero)."""
    if isinstance(earlier, torch.cuda.Event):
        return max(0.0, earlier.elapsed_time(later) / 1e3)
    return max(0.0, float(later - earlier))


def summarize_steps(records: list[StepRecord] | list[list[Any]], start: float, end: float) -> dict[str, Any]:
    """Where the device's time went between `start` and `end` (time.monotonic()): the steps launched
    in that span, their kinds, the device time and new tokens of each kind (a prefill step's
    tokens count the decode rows a mixed step takes along), and the device's idle time: before the
    first step (requests still arriving), between steps (the host late), and before prefill steps
    among those."""
    steps = [StepRecord(*record) for record in records]
    steps = [step for step in steps if start <= step.launched_at <= end]
    if not steps:
        return {"steps": 0}
    decode = [step for step in steps if step.decode]
    gaps = [step.gap_s or 0.0 for step in steps[1:]]
    return {
        "steps": len(steps),
        "prefill_steps": len(steps) - len(decode),
        "mean_decode_rows": sum(step.rows for step in decode) / len(decode) if decode else 0.0,
        "first_step_after_s": steps[0].launched_at - start,
        "device_busy_s": sum(step.busy_s for step in steps),
        "prefill_busy_s": sum(step.busy_s for step in steps if not step.decode),
        "prefill_tokens": sum(step.tokens for step in steps if not step.decode),
        "decode_busy_s": sum(step.busy_s for step in decode),
        "decode_tokens": sum(step.tokens for step in decode),
        "gap_s": sum(gaps),
        "gap_before_prefill_s": sum(step.gap_s or 0.0 for step in steps[1:] if not step.decode),
        "largest_gap_ms": max(gaps, default=0.0) * 1e3,
    }
