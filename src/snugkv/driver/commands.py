"""What a driver asks of an engine core, one turn at a time: the commands every rank applies.

A turn is the list of commands rank 0 took in since its last one (requests added and aborted, KV
resizes, sleep and wake, a prefix-cache reset, a memory check, stop). With tensor parallelism rank 0 sends each
turn to the other ranks before applying it (`EngineCore.share`), so every rank applies the same
commands in the same order. Commands are small frozen values that pickle cheaply; they carry no
reply channel (a driver keeps its own, keyed by the command's place in the turn).
"""

from __future__ import annotations

from dataclasses import dataclass

from snugkv.core.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class Add:
    """Queue a request (`InvalidRequest` on every rank alike when it cannot run)."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class Abort:
    rid: str


@dataclass(frozen=True, slots=True)
class AbortAll:
    """End every request in flight with finish_reason "abort" (the server is stopping)."""


@dataclass(frozen=True, slots=True)
class Stop:
    """The last turn: the other ranks leave their loop."""


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


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    """Drop every unlocked prefix-cache entry (`LLM.reset_prefix_cache`)."""


@dataclass(frozen=True, slots=True)
class CheckMemory:
    """Measure free device memory (MIN over ranks) and shrink or grow the KV cache under memory
    pressure (`driver.pressure`); rank 0's clock adds it to a turn (`EngineCore.share`), so every
    rank measures and decides at the same point."""


@dataclass(frozen=True, slots=True)
class ExpireWait:
    """End a request that waited `--queue-timeout` for KV memory in vain (a 503 with Retry-After);
    rank 0's clock decides, so every rank ends it at the same turn."""

    rid: str


Command = (
    Add | Abort | AbortAll | Stop | ResizeKV | Sleep | WakeUp | ResetPrefixCache | CheckMemory | ExpireWait
)
Turn = list[Command]
