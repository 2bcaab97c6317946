"""Sizing at run time: which token counts a resize may ask for, and what a resize did.

A running engine's KV cache can grow up to the address space reserved at start-up, the user's
`--max-total-tokens` and what `--max-device-memory` leaves it, and shrink down to two pages.
`ResizeLimits` holds those bounds and refuses a count outside them with a message naming the
limit and the flag (`core.reports.KvResize` records what a resize did). Measuring memory stays in
`measure`; moving memory is the runner's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from snugkv.memory.kv_pool import KVPool


class KvResizeError(ValueError):
    """A resize the engine refuses; the message names the limit or what to do first.

    `status` is the HTTP status the server answers with: 400 for a count outside the limits, 409
    when the engine's state refuses it (asleep, sized without virtual memory, memory taken).
    `param` names the request field at fault, if one is.
    """

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True, slots=True)
class ResizeLimits:
    """The bounds on `max_total_num_tokens` now (all page multiples)."""

    page_size: int
    min_tokens: int  # two pages: one for a prompt, one for its first new token
    reserved_tokens: int  # the address space laid out at start-up
    max_total_tokens: int | None  # --max-total-tokens
    cap_tokens: int | None  # what --max-device-memory leaves the KV cache
    max_device_memory_gib: float | None

    @property
    def max_tokens(self) -> int:
        bounds = [self.reserved_tokens, self.max_total_tokens, self.cap_tokens]
        return min(bound for bound in bounds if bound is not None) // self.page_size * self.page_size

    def check(self, num_tokens: object, param: str = "max_total_num_tokens") -> int:
        """`num_tokens` rounded down to whole pages, or `KvResizeError` naming the limit it breaks."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise KvResizeError(
                f"{param} must be an integer number of tokens, got {num_tokens!r}", param=param
            )
        if num_tokens < self.min_tokens:
            raise KvResizeError(
                f"{param}={num_tokens} is below the smallest KV cache, {self.min_tokens} tokens (two pages of "
                f"{self.page_size}); ask for at least {self.min_tokens}",
                param=param,
            )
        if num_tokens > self.reserved_tokens:
            raise KvResizeError(
                f"{param}={num_tokens} is above the {self.reserved_tokens} tokens whose address space was "
                f"reserved at start-up (the reserve bounds every resize); ask for at most {self.max_tokens}",
                param=param,
            )
        if self.max_total_tokens is not None and num_tokens > self.max_total_tokens:
            raise KvResizeError(
                f"{param}={num_tokens} is above --max-total-tokens {self.max_total_tokens}; ask for at most "
                f"{self.max_tokens} (or restart with a larger --max-total-tokens)",
                param=param,
            )
        if self.cap_tokens is not None and num_tokens > self.cap_tokens:
            raise KvResizeError(
                f"{param}={num_tokens} is above what --max-device-memory {self.max_device_memory_gib:g} GiB "
                f"leaves the KV cache ({self.cap_tokens} tokens); ask for at most {self.max_tokens}",
                param=param,
            )
        return num_tokens // self.page_size * self.page_size


MAX_FREE_GIB = 1 << 20  # 1 PiB: beyond every device


def check_free_gib(free_gib: object) -> float:
    """A `free_gib` request value: a finite number >= 0, or `KvResizeError`."""
    if isinstance(free_gib, bool) or not isinstance(free_gib, int | float) or not math.isfinite(free_gib):
        raise KvResizeError(f"free_gib must be a number of GiB, got {free_gib!r}", param="free_gib")
    if free_gib < 0:
        raise KvResizeError(
            f"free_gib={free_gib} is negative; it is the device memory to leave free beyond the activation "
            "headroom (0 or more)",
            param="free_gib",
        )
    if free_gib > MAX_FREE_GIB:  # also keeps free_gib * GIB a finite number of bytes
        raise KvResizeError(
            f"free_gib={free_gib:g} is more memory than any device has; ask to leave at most {MAX_FREE_GIB} GiB free",
            param="free_gib",
        )
    return float(free_gib)


def cap_tokens(pool: KVPool, kv_cap_bytes: int | None) -> int | None:
    """The most tokens whose backing fits what `--max-device-memory` leaves the KV cache."""
    return None if kv_cap_bytes is None else pool.max_tokens_within(kv_cap_bytes)
