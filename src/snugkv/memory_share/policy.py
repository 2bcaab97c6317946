"""How elastic engines on one device share its memory: pure functions, no I/O, no clock.

The pool. The KV memory the running elastic engines share is what is free on the device now plus
what their KV caches hold, less every running engine's activation headroom and less what starting
engines ask for (their weights, graphs, headroom and a minimum KV cache): `pool = free + sum(kv) -
sum(headroom) - sum(asks)`. A sleeping engine holds no KV and takes no part.

The split (`plan_targets`). Every engine first gets its minimum. Above it, demands (tokens in use
and waiting, with slack) are filled in proportion to the engines' weights (`--memory-share`), so
when all are busy each keeps its weighted share and none takes another's; memory that no demand
takes is then split by weight too. No engine gets more than its maximum (its reserved address
space and caps). If the minimums alone exceed the pool, every engine stays at its minimum.

The step (`decide`). Each engine computes its own target and changes only its own KV cache:
- it never grows beyond what is free now less the reserve (headrooms, asks), so it grows only
  into memory another engine or process has already given back;
- if free memory is below the reserve by more than the band's floor (an engine is starting and
  its ask is not met yet, or a process outside snugkv took memory) it shrinks at once by the
  deficit (no more), whatever the interval; a granted ask no longer counts (the starter is
  loading into it), and while an engine starts the others make no other move;
- otherwise it moves to its target only when the difference exceeds the hysteresis band (a fraction
  of its size, and a floor in bytes) and its last resize is at least `min_interval_s` old. Two
  engines fed the same record compute consistent targets, and the band keeps noise in the demands
  from moving memory back and forth; after any engine's resize the others wait half the interval,
  so they decide on entries that show it. A resize is published as in flight before it starts (a
  grow with its new size: a reader that sees the memory gone also sees who took it), and the
  others make no move but an urgent one until it is done.

The start split (`start_cohort`, `start_plan`). Engines that start together (registered and
loading at once, none of them sized yet) split what is free at their sizing point among them
before any commits: free memory as the last of them to arrive measured it (every cohort's weights
and graphs loaded by then; the starters' holds of the running engines' headroom added back), less
the running (and already sized) engines' headroom, the start room, the asks of engines outside the
cohort, each member's own headroom, and, for a member that has not arrived (the wait for it ran
out), what it still loads (its ask less its minimum KV). Every member gets its minimum, the rest is
split by weight up to each maximum: what `plan_targets` gives them once they run, so no rebalance
follows.

The wake (`wake_kv_bytes`). A sleeping engine that wakes asks like a starting one; the KV part of
its ask is its size before it slept, bounded by the target the split would give it were it running
now (so the others keep their minimums and their weighted shares of demand), and never below its
own minimum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from snugkv.memory.vmm import MIB
from snugkv.memory_share.record import LOADING, RUNNING, SIZED, SIZING, STARTING, EngineEntry, StartPlan


@dataclass(frozen=True, slots=True)
class SharePolicy:
    """The knobs of rebalancing (the defaults are what `--kv-elastic` uses)."""

    hysteresis_fraction: float = 0.10  # of the larger of now and the target
    hysteresis_min_bytes: int = 32 * MIB
    min_interval_s: float = 2.0  # between two non-urgent resizes of one engine
    demand_slack: float = 1.25  # demand grows while requests decode: ask for a quarter more
    resize_stale_s: float = 60.0  # a resize in flight longer than this no longer holds the others


@dataclass(frozen=True, slots=True)
class Decision:
    """What one engine does this turn: resize to `target_bytes`, or nothing (None), and why."""

    target_bytes: int | None
    reason: str
    urgent: bool = False


def effective_free_bytes(entries: Sequence[EngineEntry], device_free_bytes: int) -> int:
    """The device's free memory as every engine counts it: running engines' cached activation
    blocks are their headroom already (held, but counted in `reserve_bytes`), so they are added
    back; the starter and the running engines then agree on what is short."""
    cached = sum(min(e.cached_bytes, e.headroom_bytes) for e in entries if e.state == RUNNING)
    return device_free_bytes + cached


def pool_bytes(entries: Sequence[EngineEntry], free_bytes: int) -> int:
    """KV memory the running engines share (see the module docstring)."""
    return free_bytes + sum(e.kv_bytes for e in entries if e.state == RUNNING) - reserve_bytes(entries)


def reserve_bytes(entries: Sequence[EngineEntry], *, to_give: bool = False) -> int:
    """Memory that must stay free: running engines' headroom and starting engines' asks. With
    `to_give`, what running engines must still give: a granted ask is being loaded into (free
    memory falls as the starter loads; that is no reason to give more)."""
    running = [e for e in entries if e.state == RUNNING]
    headroom = sum(e.headroom_bytes for e in running)
    start_room = max((e.start_room_bytes for e in running), default=0)  # a starter asks from there
    asks = [e for e in entries if e.state == STARTING and not (to_give and e.granted)]
    return headroom + start_room + sum(e.need_bytes for e in asks)


def _fill(given: dict[int, float], caps: dict[int, float], budget: float, weights: dict[int, float]) -> float:
    """Add up to `budget` to `given`, in proportion to `weights`, none above its cap; returns what
    is left (weighted water-filling)."""
    while budget > 1e-6:
        open_ = [pid for pid in given if caps[pid] - given[pid] > 1e-6]
        if not open_:
            break
        total_weight = sum(weights[pid] for pid in open_)
        spent = 0.0
        for pid in open_:
            add = min(budget * weights[pid] / total_weight, caps[pid] - given[pid])
            given[pid] += add
            spent += add
        budget -= spent
    return budget


def plan_targets(entries: Sequence[EngineEntry], free_bytes: int, policy: SharePolicy) -> dict[int, int]:
    """Each running engine's KV target in bytes (by pid)."""
    running = [e for e in entries if e.state == RUNNING]
    if not running:
        return {}
    weights = {e.pid: max(e.weight, 1e-9) for e in running}
    given = {e.pid: float(e.min_kv_bytes) for e in running}
    budget = pool_bytes(entries, free_bytes) - sum(given.values())
    if budget <= 0:
        return {pid: int(value) for pid, value in given.items()}
    wants = {
        e.pid: min(max(e.demand_bytes * policy.demand_slack, e.min_kv_bytes), e.max_kv_bytes) for e in running
    }
    budget = _fill(given, wants, budget, weights)
    _fill(given, {e.pid: float(e.max_kv_bytes) for e in running}, budget, weights)
    return {pid: int(value) for pid, value in given.items()}


def decide(
    me: EngineEntry,
    entries: Sequence[EngineEntry],
    free_bytes: int,
    *,
    seconds_since_resize: float,
    seconds_since_others_resized: float,
    policy: SharePolicy,
) -> Decision:
    """This engine's move now (`entries` includes `me`; `free_bytes` is the device's free memory;
    the seconds since this engine's last resize and since any other engine's)."""
    current = me.kv_bytes
    target = plan_targets(entries, free_bytes, policy).get(me.pid)
    if target is None:
        return Decision(None, "not running")
    deficit = reserve_bytes(entries, to_give=True) - free_bytes
    if deficit > policy.hysteresis_min_bytes:  # someone needs memory now: give it without waiting
        # From the size in tokens, not the committed bytes: a shrink that cut through an extension
        # it had no memory to split keeps that extension, and the next turn must still go lower.
        logical = min(me.kv_tokens * me.bytes_per_token, current) if me.kv_tokens else current
        shrink_to = max(logical - deficit, me.min_kv_bytes)
        if shrink_to < logical:
            reason = f"free memory is {deficit / MIB:.0f} MiB below the reserve"
            return Decision(shrink_to, reason, urgent=True)
        return Decision(None, "below the reserve, but already at the minimum")
    if any(e.state == STARTING for e in entries):  # it loads into free memory: hold still meanwhile
        return Decision(None, "an engine is starting")
    resizing = any(e.resizing for e in entries if e.pid != me.pid)
    if resizing and seconds_since_others_resized < policy.resize_stale_s:  # memory and entry disagree
        return Decision(None, "another engine is resizing")
    band = max(policy.hysteresis_fraction * max(current, target), policy.hysteresis_min_bytes)
    if abs(target - current) <= band:
        return Decision(None, "within the hysteresis band")
    if seconds_since_resize < policy.min_interval_s:
        return Decision(None, "resized too recently")
    if seconds_since_others_resized < policy.min_interval_s / 2:  # their entries catch up first
        return Decision(None, "another engine resized a moment ago")
    if target < current:
        return Decision(target, "rebalance: give memory to the others")
    spare = max(free_bytes - reserve_bytes(entries), 0)
    grow_to = min(target, current + spare)  # only into memory that is free already
    if grow_to - current <= band:
        return Decision(None, "waiting for memory to be given back")
    return Decision(grow_to, "rebalance: grow into free memory")


def wake_kv_bytes(
    me: EngineEntry, entries: Sequence[EngineEntry], free_bytes: int, previous_bytes: int, policy: SharePolicy
) -> int:
    """The KV cache a sleeping engine `me` asks for to wake (see the module docstring): `entries`
    may include `me` (it is counted as running, with no KV yet); `previous_bytes` is its KV cache
    before it slept."""
    woken = replace(me, state=RUNNING, kv_bytes=0, kv_tokens=0, need_bytes=0, granted=False)
    others = [e for e in entries if e.pid != me.pid]
    target = plan_targets([*others, woken], free_bytes, policy).get(me.pid, me.min_kv_bytes)
    return max(me.min_kv_bytes, min(previous_bytes, target))


def start_cohort(me: int, entries: Sequence[EngineEntry]) -> list[EngineEntry]:
    """The engines starting together with engine `me` (it included): every starter loading or at its
    sizing point (a wake's ask, a late starter, a sized one are not)."""
    cohort = [e for e in entries if e.state == STARTING and e.start_phase in (LOADING, SIZING)]
    return sorted(cohort, key=lambda e: e.pid) if any(e.pid == me for e in cohort) else []


def start_plan(cohort: Sequence[EngineEntry], entries: Sequence[EngineEntry], *, now: float) -> StartPlan:
    """The KV bytes each member of `cohort` (some at their sizing point) commits (see the module
    docstring); `entries` is the whole record, the cohort included."""
    members = {e.pid for e in cohort}
    arrived = [e for e in cohort if e.start_phase == SIZING]
    pending = [e for e in cohort if e.start_phase != SIZING]
    others = [e for e in entries if e.pid not in members]
    kept = [e for e in others if e.state == RUNNING or (e.state == STARTING and e.start_phase == SIZED)]
    asks = [e for e in others if e.state == STARTING and e.start_phase != SIZED]
    free = min(e.sizing_free_bytes for e in arrived)
    reserve = (
        sum(e.headroom_bytes for e in [*kept, *arrived])
        + max((e.start_room_bytes for e in [*kept, *arrived]), default=0)
        + sum(e.need_bytes for e in asks)
        + sum(max(e.need_bytes - e.min_kv_bytes, 0) for e in pending)
    )
    weights = {e.pid: max(e.weight, 1e-9) for e in cohort}
    given = {e.pid: float(e.min_kv_bytes) for e in cohort}
    budget = free + sum(e.kv_bytes for e in arrived) - reserve - sum(given.values())
    if budget > 0:
        caps = {e.pid: float(e.max_kv_bytes) if e.max_kv_bytes > 0 else float("inf") for e in cohort}
        _fill(given, caps, budget, weights)
    return StartPlan(
        grants={pid: int(value) for pid, value in given.items()},
        free_bytes=free,
        reserve_bytes=reserve,
        pending=tuple(e.pid for e in pending),
        made_at=now,
    )
