"""Memory pressure on the driver's turn: the one place that decides a pressure move.

Start-up measured what was free then; another process may take device memory later, and the
activation headroom the engine keeps beside its KV cache would go with it. Every `MEMORY_CHECK_S`
rank 0 adds a `CheckMemory` command to the turn (`EngineCore.share`); every rank applies it here,
at the same point of the same turn, on the same state, so every rank takes the same decision. A
move asks each layer once for its part and every call goes down from here: the scheduler and the
engine never call each other for it, and the one hook back up is the prefix cache's slot rewrite,
which the shrink runs between copying the pages and decommitting them (`on_move`):

    watch       the engine: may its KV cache move now (`Engine.watches_pressure`: it can resize,
                and `--no-kv-pressure` was not given)
    measure     the engine's KV sizing object: free memory, the MIN over ranks, and how far
                (`KvSizing.pressure_move`: a shrink by the deficit and a slack, or a grow back with
                hysteresis); the step in flight runs on meanwhile, as almost every check ends here
    settle      the scheduler reads the step in flight (`Scheduler.finish_in_flight`), so the
                requests' sizes below are final
    floor       a shrink goes no lower than the largest live request needs
                (`scheduler.elastic.smallest_size`); if the requests hold all of it, nothing moves
    check       the engine's limits, once, before anything gives way (`KvSizing.target`)
    make room   the scheduler evicts cache entries (into the host tier first, where there is one:
                as much as `--kv-pressure-spill-ms` of copies at its measured bandwidth writes, the
                rest is dropped, so the other process is not kept waiting behind a long spill), then
                retracts the newest requests, until what is in use fits
                (`scheduler.elastic.make_room`; a grow needs none)
    resize      the engine moves the live pages and decommits, or commits on every rank or none
                (`Engine.resize_kv`), and records the change as "pressure" or "pressure-grow"

A refusal (`KvResizeError`: memory went between the measure and the commit) is logged and the next
check tries again; any other failure is left to the engine core, which ends the requests in flight.

This module never measures, sizes or moves memory and never picks which requests give way: it
orders the layers' calls and owns the decision between them.
"""

from __future__ import annotations

import logging

from snugkv.core.reports import KvResize
from snugkv.engine import Engine
from snugkv.scheduler import elastic
from snugkv.scheduler.scheduler import Scheduler
from snugkv.sizing.resize import KvResizeError

logger = logging.getLogger(__name__)


def relieve_pressure(scheduler: Scheduler, engine: Engine) -> KvResize | None:
    """One memory check on this rank: shrink or grow the KV cache of `engine`, which `scheduler`
    runs on, as the free memory of now says. Returns the change, or None (it stays, or the move
    was refused and logged)."""
    if not engine.watches_pressure:
        return None
    kv = engine.kv
    move = kv.pressure_move()
    if move is None:
        return None
    scheduler.finish_in_flight()  # a launched step's tokens and slots are settled before sizes are read
    tokens = max(move.tokens, elastic.smallest_size(scheduler)[0]) if move.shrinks else move.tokens
    if move.shrinks and tokens >= kv.committed_tokens:  # the live requests hold all of it: nothing gives way
        return None
    try:
        target = kv.target(tokens)
        room = (
            elastic.make_room(
                scheduler, target.tokens, spill_budget_s=engine.args.memory.kv_pressure_spill_ms / 1e3
            )
            if move.shrinks
            else elastic.RoomMade()
        )
        change = elastic.resize_after_room(
            scheduler, engine, target, room, reason=move.reason, free_bytes=move.free.min_bytes
        )
    except KvResizeError as exc:  # memory went between the measure and the commit: the next check retries
        logger.warning("KV %s to %d tokens refused: %s", move.reason, tokens, exc)
        return None
    return change  # the scheduler's request cap reads the engine's re-capped limit
