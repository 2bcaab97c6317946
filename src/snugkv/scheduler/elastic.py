"""Elastic memory on the scheduler thread: who gives way when the KV cache shrinks, and sleeping
and waking, between steps.

A shrink never fails a request. The smallest size that fails none holds the largest live request
(its tokens plus one page: `smallest_size`). To make room for a smaller size (`make_room`) the
prefix cache gives up its unlocked entries above the new bound; if what stays in use still does not
fit below it, more cache entries go (least recently used first), and only when the cache has
nothing left to give are requests retracted, newest first (their KV goes to the cache, they wait
and are recomputed). Then the engine moves the live pages below the bound (the cache follows
through `remap_slots`) and decommits the rest. A grow only commits. Every rank runs this on the
same commands, so every rank evicts, retracts and moves alike.

An explicit resize (`resize_kv`: `POST /kv/resize`, `LLM.resize_kv`, the memory share) runs here:
the engine checks the size, a size below `smallest_size` is refused naming the request, room is
made, the engine resizes. Memory pressure is decided on the driver's turn (`driver.pressure`),
which asks this module only for `smallest_size` and `make_room`.

Sleep retracts every request in flight (they wait in the queue; nothing is lost), empties the
prefix cache and pauses the scheduler; wake sizes the KV cache again and lets the queue run.

With a host tier, what leaves the device is written there first: the cache entries a shrink
evicts (`make_room`) and, at sleep level 1, every cached prefix; only what the host tier cannot
hold is dropped. A shrink someone asked for (`POST /kv/resize`, `LLM.resize_kv`, the memory share)
and sleep spill all of it, however long the copies take: the caller waits for its answer. A
memory-pressure move spills only what its time budget writes (`make_room(spill_budget_s=)`, the
driver's `--kv-pressure-spill-ms`) and drops the rest: another process waits for that memory. Level 2 drops both tiers (it may
come back with new weights). After a wake the prefixes load back from the host tier at their
next hit, not before (the woken cache may be smaller, and a load waits for a request that wants it).

This module holds the policy of who gives way; the memory itself moves in
snugkv.runner.kv_resize and the token counts are the engine's KV sizing object's
(snugkv.engine.kv_sizing: its committed size is read through `KvSizing.committed_tokens`, never
its pool).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from snugkv.core.reports import KvInfo, KvResize, LargestRequest
from snugkv.engine import Engine
from snugkv.engine.kv_sizing import KvTarget
from snugkv.scheduler.request import Request
from snugkv.scheduler.scheduler import Scheduler
from snugkv.sizing.resize import KvResizeError


def smallest_size(scheduler: Scheduler) -> tuple[int, Request | None]:
    """The fewest tokens the cache can shrink to without failing a live request: the largest one's
    tokens plus a page (room for its next token), at least two pages; and that request. A queued
    request the cache does not hold now anyway (it waits for memory) does not count. Exact once the
    step in flight is settled (`Scheduler.finish_in_flight`: its tokens count then)."""
    page = scheduler.page_size
    live = [*(r for r in scheduler.waiting if not scheduler.waits_for_memory(r)), *scheduler.running]
    largest = max(live, key=lambda r: r.num_tokens, default=None)
    if largest is None:
        return 2 * page, None
    return max(2 * page, -(-largest.num_tokens // page) * page + page), largest


@dataclass(frozen=True, slots=True)
class RoomMade:
    """What the scheduler gave up so that what is in use fits a smaller KV cache (for the record)."""

    evicted_tokens: int = 0
    retracted_requests: int = 0
    dropped_tokens: int = 0  # of evicted_tokens, those kept nowhere (the rest went to the host tier)
    took_ms: float = 0.0


def resize_after_room(
    scheduler: Scheduler, engine: Engine, target: KvTarget, room: RoomMade, **record: Any
) -> KvResize:
    """Resize the engine's KV cache to `target` once `room` is made: its moves remap the prefix
    cache, and what the room gave up goes into the record (`record`: the engine's other fields)."""
    return engine.resize_kv(
        target,
        on_move=lambda moves: scheduler.cache.remap_slots(moves.full),
        evicted_tokens=room.evicted_tokens,
        retracted_requests=room.retracted_requests,
        dropped_tokens=room.dropped_tokens,
        room_ms=room.took_ms,
        **record,
    )


def make_room(scheduler: Scheduler, tokens: int, *, spill_budget_s: float | None = None) -> RoomMade:
    """Free pages until what is in use fits below `tokens`: cache entries above the bound, then
    any unlocked cache entries, then retract requests newest first. The step in flight must be
    settled first (`Scheduler.finish_in_flight`), and `tokens` must hold the largest live request
    (`smallest_size`): then it always fits. `spill_budget_s`: the evicted entries written to the
    host tier are those its measured bandwidth writes in that time (the rest are dropped); None:
    all it holds."""
    started = time.perf_counter()
    allocator, cache, page = scheduler.runner.allocator, scheduler.cache, scheduler.page_size
    budget = cache.spill_budget(spill_budget_s)
    dropped_before = cache.dropped_tokens
    evicted = cache.evict_at_or_above(tokens + page, budget)  # slot tokens + page: the first past the new end
    retracted = 0
    while allocator.plan_shrink(tokens) is None:
        if cache.evictable_tokens:
            in_use = allocator.capacity_tokens - allocator.available_tokens
            evicted += cache.evict(max(in_use - tokens, page), budget)
            continue
        admitted = [r for r in (*scheduler.running, *scheduler.waiting) if r.is_admitted]
        if not admitted:  # nothing left to give: the slots leaked (a bug, never a user error)
            raise RuntimeError(f"KV shrink to {tokens} tokens: nothing left to evict or retract")
        scheduler.retract(max(admitted, key=lambda r: r.seq))  # the newest
        retracted += 1
    dropped = cache.dropped_tokens - dropped_before
    return RoomMade(evicted, retracted, dropped, (time.perf_counter() - started) * 1e3)


def resize_kv(
    scheduler: Scheduler,
    engine: Engine,
    *,
    max_total_num_tokens: int | None = None,
    free_gib: float | None = None,
) -> KvResize:
    """Resize `engine`'s KV cache, which `scheduler` runs on, to `max_total_num_tokens`, or to what
    leaves `free_gib` of device memory free (`POST /kv/resize`, `LLM.resize_kv`, the memory share).
    A shrink below what the largest live request needs is refused, naming it."""
    kv = engine.check_resizable()  # asleep or sized without virtual memory: refused before any value
    scheduler.finish_in_flight()  # a launched step's slots and tokens are settled before pages move
    if (max_total_num_tokens is None) == (free_gib is None):
        raise KvResizeError("give exactly one of max_total_num_tokens and free_gib")
    if free_gib is not None:
        target = kv.target(kv.tokens_leaving_free(free_gib))
        param = "free_gib"
    else:
        target = kv.target(max_total_num_tokens)
        param = "max_total_num_tokens"
    tokens, room = target.tokens, RoomMade()
    if tokens < kv.committed_tokens:
        minimum, largest = smallest_size(scheduler)
        if tokens < minimum and largest is not None:
            raise KvResizeError(
                f"{param} asks for {tokens} KV tokens, but request {largest.rid} holds {largest.num_tokens} "
                f"and needs a page more: the cache can shrink to {minimum} tokens now without failing a "
                "request; ask for at least that, or wait for it to finish",
                param=param,
            )
        room = make_room(scheduler, tokens)
    return resize_after_room(scheduler, engine, target, room)  # the request cap reads the re-capped limit


def demand_tokens(scheduler: Scheduler) -> int:
    """KV tokens the requests want now: what admitted ones hold, the prompts still waiting for a slot,
    and a page each for the next tokens (what `--kv-elastic` engines share memory by)."""
    page = scheduler.page_size
    waiting = sum(-(-r.num_tokens // page) * page for r in scheduler.waiting if not r.is_admitted)
    return scheduler.held_tokens() + waiting + page * (len(scheduler.running) + len(scheduler.waiting))


def kv_info(scheduler: Scheduler, engine: Engine) -> KvInfo:
    """GET /kv: the engine's view plus what the requests hold and the smallest size now."""
    minimum, largest = smallest_size(scheduler)
    return KvInfo(
        cache=engine.kv_info(),
        held_by_requests_tokens=scheduler.held_tokens(),
        demand_tokens=demand_tokens(scheduler),
        cached_tokens=scheduler.cache.cached_tokens,
        evictable_cached_tokens=scheduler.cache.evictable_tokens,
        min_tokens_without_failing_a_request=minimum,
        largest_request=None if largest is None else LargestRequest(largest.rid, largest.num_tokens),
        num_running_requests=len(scheduler.running),
        num_queued_requests=len(scheduler.waiting),
    )


def sleep(scheduler: Scheduler, engine: Engine, *, level: int = 1, tags: tuple[str, ...] = ()) -> KvResize:
    """Pause the scheduler and release memory. Requests in flight are retracted (they wait in the
    queue, nothing is lost) and the prefix cache is emptied when the KV cache goes."""
    chosen = engine.check_sleep(level, tags)
    scheduler.finish_in_flight()  # the launched step reads the KV cache and weights about to go
    if "kv_cache" in chosen - engine.sleeping_tags:
        for request in sorted(
            (r for r in (*scheduler.running, *scheduler.waiting) if r.is_admitted), key=lambda r: -r.seq
        ):
            scheduler.retract(request)
        if level == 1:  # the cached prefixes wait in the host tier (as far as it holds them)
            scheduler.cache.spill_all()
        else:  # level 2 may come back with new weights: the old KV is no prefix of anything then
            scheduler.cache.reset()
    result = engine.sleep(level, tags)
    scheduler.paused = engine.is_sleeping
    return result


def wake_up(scheduler: Scheduler, engine: Engine, *, tags: tuple[str, ...] = ()) -> KvResize:
    """Take memory back; once nothing sleeps, the queue runs again. A queued request the re-sized
    cache could never hold ends with an error saying so (the only request a wake can fail); one it
    could hold once it grows waits for memory."""
    scheduler.finish_in_flight()
    result = engine.wake_up(tags)
    if not engine.is_sleeping:
        capacity = scheduler.runner.allocator.capacity_tokens
        could_hold = capacity if scheduler.could_hold_tokens is None else scheduler.could_hold_tokens
        for request in [r for r in scheduler.waiting if r.num_tokens + scheduler.page_size > could_hold]:
            scheduler.fail(
                request,
                f"the KV cache woke up holding {capacity} tokens, fewer than this request needs "
                f"({request.num_tokens} and a page); send it again shorter",
            )
        scheduler.paused = False
    return result
