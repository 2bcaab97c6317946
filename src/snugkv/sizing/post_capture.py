"""Post-capture sizing: turn measured free memory into a token count and back it.

Tokens = (free - headroom) / bytes per token over all buffers (the pool's own byte math,
granule alignment and sub-pool ratios included), capped by the pool's virtual upper bound and
the user's `--max-total-tokens`, agreed as the MIN over ranks. The commit retries with fewer
tokens when another process took memory meanwhile; it never leaves a half-mapped pool.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch.distributed as dist

from snugkv.memory.kv_pool import KVPool
from snugkv.memory.vmm import GIB, CommitError
from snugkv.sizing.measure import FreeMemory, agree_min

logger = logging.getLogger(__name__)

RETRY_SHRINK = 0.95
MAX_RETRIES = 8


class SizingError(RuntimeError):
    """No KV cache could be backed; the message says what to change."""


@dataclass(frozen=True, slots=True)
class SizingResult:
    max_total_num_tokens: int
    committed_bytes: int
    headroom_bytes: int
    free_before: FreeMemory
    took_ms: float
    retries: int


def tokens_for_budget(
    pool: KVPool,
    free_bytes: int,
    headroom_bytes: int,
    max_total_tokens: int | None,
    kv_cap_bytes: int | None = None,
) -> int:
    """The most tokens whose backing fits `free - headroom` (what the pool already backs counts as
    usable) and, under `--max-device-memory`, `kv_cap_bytes` (what the cap leaves the KV cache)."""
    budget = free_bytes - headroom_bytes + pool.committed_bytes
    if kv_cap_bytes is not None:
        budget = min(budget, kv_cap_bytes)
    return pool.max_tokens_within(budget, max_total_tokens)


def finalize_with_retry(pool: KVPool, tokens: int, group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """Back `tokens`, shrinking by 5% per failed attempt; every rank ends on the same count.

    Returns (tokens, retries).
    """
    for attempt in range(MAX_RETRIES + 1):
        try:
            backed = pool.finalize_backing(tokens)
            ok = 1
        except CommitError as exc:
            backed, ok = 0, 0
            logger.warning("KV commit of %d tokens failed (%s); retrying with fewer tokens.", tokens, exc)
        if agree_min(ok, group):
            return backed, attempt
        if ok:  # another rank failed: give back what this rank took, then try together
            pool.finalize_backing(0)
        page = pool.page_size
        tokens = min(int(tokens * RETRY_SHRINK) // page * page, tokens - page)  # at least a page less
        if tokens <= 0:
            break
    raise SizingError(
        "could not back any KV cache after retries: free memory is being taken by another process; "
        "stop it, or pass --max-total-tokens to ask for less"
    )


def size_post_capture(
    pool: KVPool,
    free: FreeMemory,
    headroom_bytes: int,
    max_total_tokens: int | None = None,
    group: dist.ProcessGroup | None = None,
    kv_cap_bytes: int | None = None,
) -> SizingResult:
    """Size a bare pool from a measurement and commit it: the steps the engine's `KvSizing` takes,
    over a pool without an engine around it."""
    start = time.perf_counter()
    tokens = tokens_for_budget(pool, free.min_bytes, headroom_bytes, max_total_tokens, kv_cap_bytes)
    tokens = agree_min(tokens, group)
    if tokens <= 0:
        raise SizingError(no_kv_memory_message(free, headroom_bytes))
    tokens, retries = finalize_with_retry(pool, tokens, group)
    took_ms = (time.perf_counter() - start) * 1e3
    return SizingResult(tokens, pool.committed_bytes, headroom_bytes, free, took_ms, retries)


def no_kv_memory_message(free: FreeMemory, headroom_bytes: int, guest_room_bytes: int = 0) -> str:
    """Why start-up found no room for any KV cache, and what to change."""
    guest = (
        f" and {guest_room_bytes / GIB:.2f} GiB more as guest room for other processes (--guest-room-mib)"
        if guest_room_bytes
        else ""
    )
    return (
        f"no memory left for the KV cache: {free.min_bytes / GIB:.2f} GiB free after graph capture, "
        f"{headroom_bytes / GIB:.2f} GiB kept as activation headroom{guest}. Use a smaller model, fewer or "
        "smaller CUDA graphs (--cuda-graph-max-bs), a smaller --chunked-prefill-size"
        + (" or a smaller --guest-room-mib" if guest_room_bytes else "")
    )


def recap_running_requests(max_running_requests: int, max_total_num_tokens: int, page_size: int) -> int:
    """Every running request holds at least one page: never admit more than the pool has pages."""
    cap = max(1, max_total_num_tokens // page_size)
    if cap < max_running_requests:
        logger.warning(
            "max_running_requests lowered from %d to %d: the KV pool holds only %d tokens",
            max_running_requests,
            cap,
            max_total_num_tokens,
        )
        return cap
    return max_running_requests
