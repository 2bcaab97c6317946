"""Elastic engines that start together on one device agree on their KV shares before any commits.

Without it, engines started at the same moment each size their KV cache from all the free memory
they measure: the first to commit takes it, the others' commits fail and retry with 5% less each
time (seconds on a GPU, H200: 583,456 and 266,528 tokens, retries up to 4.3 s), and only a
rebalance evens them out. Instead:

1. Register. A starter's entry is `loading` when it registers, unless another engine is already
   at or past its sizing point (or a start plan is live): then it is `late`, waits until those run
   and asks them for memory as any later co-tenant does (`MemoryShare._wait_for_memory`). The choice
   is made under the record's lock, so a cohort never gains a member once one of it is sizing.
2. Arrive. At its sizing point (graphs captured, free memory measured) a starter publishes
   `sizing` with what it measured, plus what the starters hold for the running engines' headroom
   (the same bytes counted once whoever holds them), its headroom, bytes per token and maximum.
3. Agree. It waits until every member of its cohort (`policy.start_cohort`) has arrived, or for
   `wait_limit_s` at most; the first to find it so makes the plan (`policy.start_plan`) under the
   lock and stores it in the record, the others read their grant from it. A member that arrives
   after the plan was made without it finds its grant waiting.
4. Commit. Each commits at most its grant (the engine's own free-memory bound still applies), then
   publishes `sized`; its `running` entry follows as soon as the engine is built.

An engine alone in its cohort (a single start, or a later co-tenant beside running engines) gets no
plan and sizes as before: all free memory less its headroom, the running engines' headroom held
meanwhile. Nothing here allocates or reads the device: the engine passes what it measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from snugkv.memory_share.policy import start_cohort, start_plan
from snugkv.memory_share.record import (
    LATE,
    LOADING,
    SIZED,
    SIZING,
    STARTING,
    EngineEntry,
    ShareRecord,
    StartPlan,
)

START_POLL_S = 0.02  # the wait for the cohort rereads the record this often (a flock and a small JSON)


def sizing_in_progress(me: int, entries: list[EngineEntry], plan: StartPlan | None) -> bool:
    """Whether another engine is at or past its sizing point and not running yet, or a start plan
    is live that does not cover `me`: a new ask waits for them to run."""
    if plan is not None and me not in plan.grants:
        return True
    return any(e.pid != me and e.state == STARTING and e.start_phase in (SIZING, SIZED) for e in entries)


def registered(entry: EngineEntry, entries: list[EngineEntry], plan: StartPlan | None) -> EngineEntry:
    """`entry` as a starter (re)publishes it while it waits for memory: `loading` (one of the engines
    starting together) unless others are sizing already (`late`); once loading, it stays so."""
    if entry.start_phase == LOADING:
        return entry.beat()
    late = sizing_in_progress(entry.pid, entries, plan)
    return entry.beat(start_phase=LATE if late else LOADING)


def arrived(
    entry: EngineEntry, entries: list[EngineEntry], *, free_bytes: int, **figures: int
) -> EngineEntry:
    """`entry` at its sizing point: the free memory it measured, the starters' holds added back
    (each holds the running engines' headroom while it starts; a reserve counts it once)."""
    held = sum(e.held_bytes for e in entries if e.pid != entry.pid) + entry.held_bytes
    return entry.beat(start_phase=SIZING, sizing_free_bytes=free_bytes + held, **figures)


def wait_for_start_plan(
    record: ShareRecord, entry: EngineEntry, *, wait_limit_s: float
) -> tuple[StartPlan | None, float]:
    """Wait (at most `wait_limit_s`) for the engines starting with `entry` (published `sizing`) to
    reach their sizing points; returns the plan that covers it, or None when it starts alone, and
    the seconds it waited."""
    started = time.monotonic()
    while True:
        waited = time.monotonic() - started
        entries, plan = record.agree_start(entry.beat(), _planner(entry.pid, overdue=waited >= wait_limit_s))
        if plan is not None:
            return plan, waited
        # No one else starting with it (nor will be: a cohort gains no member once one is sizing);
        # or, past the limit, a plan made for others without it (it registered late): it sizes alone.
        if len(start_cohort(entry.pid, entries)) < 2 or waited >= wait_limit_s:
            return None, waited
        time.sleep(START_POLL_S)


def _planner(me: int, *, overdue: bool) -> Callable[[list[EngineEntry], StartPlan | None], StartPlan | None]:
    """What engine `me` does with the record under its lock: make the cohort's plan once every member
    is at its sizing point (or, `overdue`, with those that are), else nothing yet."""

    def plan_for(entries: list[EngineEntry], live: StartPlan | None) -> StartPlan | None:
        if live is not None:  # made for others while this one registered late: no second plan
            return None
        cohort = start_cohort(me, entries)
        if len(cohort) < 2 or (not overdue and any(e.start_phase != SIZING for e in cohort)):
            return None
        return start_plan(cohort, entries, now=time.time())

    return plan_for
