"""The wake ask of an elastic engine (`snugkv serve --kv-elastic`): a sleeping engine that is asked
to wake first asks the other engines on its device for the memory it will take back, as a starting
engine does, and wakes only once they have given it.

What it asks for (`wake_need_bytes`): what the wake takes back into the shared device, that is its
weights if they slept and its graphs if they were released (on a GPU; on the host backend only the
KV cache lives in the shared budget), its activation headroom, and a KV cache of its size before
it slept bounded by the policy's share (`policy.wake_kv_bytes`), never below --kv-min-tokens.

Where it waits (`asking_to_wake`, the engine thread's wake gate): the query of its state runs on
the scheduler thread between steps, the wait (`MemoryShare.ask_to_wake`, the start's wait) in a
worker thread, so neither the event loop nor the scheduler is held; the wake command is sent once
the ask is met, while the other engines' headroom is held as at start. A wait that times out is a
409 naming who holds what; the engine stays asleep and loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Collection

from snugkv.core.reports import KvInfo, MemoryLedger
from snugkv.memory_share.policy import effective_free_bytes, wake_kv_bytes
from snugkv.memory_share.share import MemoryShare, MemoryShareError
from snugkv.sizing.resize import KvResizeError

WAKE_TAGS = frozenset({"weights", "kv_cache", "cuda_graph"})


def wake_need_bytes(
    tags: Collection[str],
    sleeping_tags: Collection[str],
    *,
    kv_bytes: int,
    headroom_bytes: int,
    ledger: MemoryLedger | None,
    on_gpu: bool,
) -> int:
    """The bytes a wake of `tags` (none: all) takes back into the shared device, given what sleeps
    and the KV cache it will ask for; 0 when the wake takes nothing there (or names an unknown tag:
    the engine's own check answers that at once)."""
    if set(tags) - WAKE_TAGS:
        return 0
    chosen = (set(tags) or WAKE_TAGS) & set(sleeping_tags)
    need = kv_bytes if "kv_cache" in chosen else 0
    if on_gpu and chosen:
        need += headroom_bytes
        if ledger is not None and "weights" in chosen:
            need += ledger.weights_bytes
        if ledger is not None and "cuda_graph" in chosen:
            need += ledger.graphs_and_buffers_bytes + ledger.graph_executables_bytes
    return need


def wake_ask_bytes(
    share: MemoryShare, info: KvInfo, ledger: MemoryLedger | None, tags: tuple[str, ...]
) -> int:
    """What this engine asks for to wake `tags` now (`info`: its `kv_info`; `ledger`: its report's,
    for what the weights and graphs take; reads the record)."""
    cache = info.cache
    kv = 0
    if "kv_cache" in cache.sleeping_tags:
        entries = share.record.entries()
        free = effective_free_bytes(entries, cache.device_free_bytes)
        previous = share.awake_kv_bytes or share.entry.min_kv_bytes
        kv = wake_kv_bytes(share.entry, entries, free, previous, share.options.policy)
    return wake_need_bytes(
        tags,
        cache.sleeping_tags,
        kv_bytes=kv,
        headroom_bytes=cache.headroom_bytes,
        ledger=ledger,
        on_gpu=share.device.type == "cuda",
    )


@contextlib.asynccontextmanager
async def asking_to_wake(share: MemoryShare, tags: tuple[str, ...]) -> AsyncIterator[None]:
    """Ask, wait off the loop until the others gave it, then let the wake run (the body)."""
    info = await share.attached.kv_info()  # on the scheduler thread, between steps
    waiting = asyncio.ensure_future(asyncio.to_thread(_ask, share, info, tags))
    try:
        asked = await asyncio.shield(waiting)
    except MemoryShareError as exc:
        raise KvResizeError(f"the engine stays asleep: {exc}", status=409) from exc
    except asyncio.CancelledError:  # the caller left: the wait ends on its own, then the hold
        waiting.add_done_callback(lambda done: _woken_if_granted(share, done))
        raise
    if not asked:
        yield
        return
    try:
        with share.holding_others_headroom():
            yield
    finally:
        share.woken()


def _ask(share: MemoryShare, info: KvInfo, tags: tuple[str, ...]) -> bool:
    """In a worker thread: ask and wait if the wake takes anything back (returns whether it asked)."""
    need = wake_ask_bytes(share, info, share.attached.server_info().startup.ledger, tags)
    if need <= 0:
        return False
    share.ask_to_wake(need)
    return True


def _woken_if_granted(share: MemoryShare, done: asyncio.Future[bool]) -> None:
    """A wait its caller left ended: a grant nobody will use is released (a failed wait did it)."""
    if not done.cancelled() and done.exception() is None and done.result():
        share.woken()
