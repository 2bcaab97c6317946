"""Keeping the schedulers of tensor-parallel ranks in step.

Only rank 0 hears clients. At every turn of its loop it sends that turn's commands (requests
added, aborts, KV resizes, sleep and wake, stop) to the other ranks over the CPU group, and every rank applies the same
commands, in the same order, to its own scheduler, then steps if there is work. A scheduler is
deterministic given its commands and the sampled tokens (which rank 0 broadcasts inside
`ModelRunner.sample_on_device`), so every rank batches the same rows and meets the others in the same
collectives. Rank 0 sends a turn even when idle (an empty one every few tens of ms), so the
others never sit in a collective long enough to time out.

At tp=1 `share` is the identity and nothing crosses a process boundary.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from snugkv.core.sampling import InvalidRequest, SamplingParams
from snugkv.distributed.group import TensorParallel
from snugkv.scheduler import elastic
from snugkv.scheduler.scheduler import Scheduler
from snugkv.sizing.resize import KvResizeError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Add:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class Abort:
    rid: str


@dataclass(frozen=True, slots=True)
class AbortAll:
    pass


@dataclass(frozen=True, slots=True)
class Stop:
    pass


@dataclass(frozen=True, slots=True)
class ResizeKV:
    """Resize the KV cache to a token count, or to what leaves `free_gib` free (MIN over ranks)."""

    max_total_num_tokens: int | None = None
    free_gib: float | None = None


@dataclass(frozen=True, slots=True)
class Sleep:
    """Release the weights and/or the KV cache (`tags`, empty: both); level 1 keeps the weights in
    host memory, level 2 drops them."""

    level: int = 1
    tags: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class WakeUp:
    tags: tuple[str, ...] = ()


Command = Add | Abort | AbortAll | Stop | ResizeKV | Sleep | WakeUp


def share(tp: TensorParallel, commands: list[Command] | None) -> list[Command]:
    """Rank 0's commands of this turn, on every rank (others pass None)."""
    return tp.broadcast_object_from_first(commands)


def apply(scheduler: Scheduler, command: Command) -> Any:
    """One command on this rank's scheduler; returns what an elastic-memory command did. `Add` raises
    `InvalidRequest` and the elastic commands `KvResizeError` on every rank alike."""
    if isinstance(command, Add):
        scheduler.add_request(command.rid, command.input_ids, command.sampling)
    elif isinstance(command, Abort):
        scheduler.abort(command.rid)
    elif isinstance(command, AbortAll):
        for rid in list(scheduler.requests):
            scheduler.abort(rid)
    elif isinstance(command, ResizeKV):
        return elastic.resize_kv(
            scheduler, max_total_num_tokens=command.max_total_num_tokens, free_gib=command.free_gib
        )
    elif isinstance(command, Sleep):
        return elastic.sleep(scheduler, level=command.level, tags=command.tags)
    elif isinstance(command, WakeUp):
        return elastic.wake_up(scheduler, tags=command.tags)
    return None


def step_once(scheduler: Scheduler, tp: TensorParallel) -> Exception | None:
    """One scheduler step; a failure ends the requests it held and is returned.

    With several ranks they first agree whether any of them failed (over the CPU group), and if
    one did, every rank ends all its requests and empties its prefix cache, so their states are
    the same again whichever rank broke. That covers failures after the step's last collective
    (output handling, detokenizing: the rank-local part of a step). A rank that fails before or
    inside a collective the others are in leaves them waiting there (NCCL) or aborts them (gloo):
    that ends the launch, not just the step.
    """
    error: Exception | None = None
    try:
        scheduler.step()
    except Exception as exc:  # one bad step must not take the engine down
        error = exc
    if not tp.any_rank(error is not None):
        return None
    if error is None:
        error = RuntimeError("a step failed on another tensor-parallel rank")
    scheduler.fail_all(f"internal error while generating: {type(error).__name__}: {error}")
    if tp.enabled:
        scheduler.cache.reset()
    return error


def follow(scheduler: Scheduler, tp: TensorParallel) -> None:
    """The loop of a rank other than 0: apply rank 0's commands and step with it, until `Stop`."""
    if tp.is_first_rank:
        raise ValueError("rank 0 leads; only the other ranks follow")
    while True:
        commands = share(tp, None)
        for command in commands:
            if isinstance(command, Stop):
                return
            with contextlib.suppress(InvalidRequest, KvResizeError):  # rank 0 refused it too and said so
                apply(scheduler, command)
        if scheduler.has_work:
            error = step_once(scheduler, tp)
            if error is not None:
                logger.error("rank %d: a step failed: %s", tp.rank, error)
