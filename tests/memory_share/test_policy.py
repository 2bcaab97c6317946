"""The sharing policy of --kv-elastic engines, on its own: targets, urgency, hysteresis, no oscillation."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from snugkv.memory.vmm import GIB, MIB
from snugkv.memory_share.policy import SharePolicy, decide, plan_targets, pool_bytes, wake_kv_bytes
from snugkv.memory_share.record import RUNNING, SLEEPING, STARTING, EngineEntry

POLICY = SharePolicy()
BPT = 128 * 1024  # bytes per token (Llama-3-8B in bf16)


def engine(pid: int, kv_gib: float, *, weight: float = 1.0, demand_gib: float = 0.0, **values) -> EngineEntry:
    kv = int(kv_gib * GIB)
    defaults = dict(
        kv_bytes=kv,
        kv_tokens=kv // BPT,
        bytes_per_token=BPT,
        min_kv_bytes=GIB // 2,
        max_kv_bytes=100 * GIB,
        demand_bytes=int(demand_gib * GIB),
        headroom_bytes=GIB,
    )
    return EngineEntry(pid, None, f"e{pid}", "", RUNNING, weight, **{**defaults, **values})


def move(
    me: EngineEntry, entries: list[EngineEntry], free: int, *, since: float = 60.0, others: float = 60.0
):
    return decide(
        me, entries, free, seconds_since_resize=since, seconds_since_others_resized=others, policy=POLICY
    )


def test_idle_engines_split_the_pool_by_weight() -> None:
    entries = [engine(1, 10, weight=1), engine(2, 10, weight=3)]
    free = 22 * GIB  # pool = 22 + 20 - 2 headroom = 40 GiB
    targets = plan_targets(entries, free, POLICY)
    assert pool_bytes(entries, free) == 40 * GIB
    assert sum(targets.values()) == pytest.approx(40 * GIB, abs=16)
    above_min = {pid: value - GIB // 2 for pid, value in targets.items()}
    assert above_min[2] == pytest.approx(3 * above_min[1], rel=1e-6)


def test_a_busy_engine_takes_what_an_idle_one_does_not_need() -> None:
    entries = [engine(1, 20, demand_gib=30), engine(2, 20, demand_gib=0)]
    targets = plan_targets(entries, 2 * GIB, POLICY)  # pool 40 GiB
    # demand with slack first (37.5 GiB), then what nobody needs (2 GiB) split by weight
    assert targets[1] == pytest.approx(30 * POLICY.demand_slack * GIB + GIB, abs=16)
    assert targets[2] == pytest.approx(GIB // 2 + GIB, abs=16)


def test_busy_engines_keep_their_weighted_shares() -> None:
    entries = [engine(1, 20, weight=1, demand_gib=100), engine(2, 20, weight=1, demand_gib=100)]
    targets = plan_targets(entries, 2 * GIB, POLICY)
    assert targets[1] == pytest.approx(20 * GIB, abs=16)
    assert targets[2] == pytest.approx(20 * GIB, abs=16)


def test_minimums_hold_when_the_pool_is_smaller_than_they_are() -> None:
    entries = [engine(1, 1, min_kv_bytes=3 * GIB), engine(2, 1, min_kv_bytes=3 * GIB)]
    assert plan_targets(entries, 0, POLICY) == {1: 3 * GIB, 2: 3 * GIB}


def test_a_starting_engines_ask_makes_a_running_one_shrink_at_once() -> None:
    me = engine(1, 30)
    starter = EngineEntry(2, None, "new", "", STARTING, 1.0, need_bytes=20 * GIB)
    decision = move(me, [me, starter], 2 * GIB, since=0.0)  # just resized: urgency ignores the interval
    assert decision.urgent
    assert decision.target_bytes is not None
    assert 30 * GIB - decision.target_bytes >= 20 * GIB - 2 * GIB + GIB  # the ask, plus its own headroom


def test_a_granted_ask_is_not_given_twice_while_the_starter_loads() -> None:
    me = engine(1, 12)
    starter = EngineEntry(2, None, "new", "", STARTING, 1.0, need_bytes=20 * GIB, granted=True)
    assert move(me, [me, starter], GIB).target_bytes is None  # its loading ate the free memory
    assert move(me, [me, starter], 40 * GIB).target_bytes is None  # and nobody grows into its ask


def test_memory_taken_outside_snugkv_makes_an_engine_shrink_to_restore_its_headroom() -> None:
    me = engine(1, 30)
    decision = move(me, [me], free_bytes := 0)
    assert free_bytes == 0
    assert decision.urgent
    assert decision.target_bytes == pytest.approx(29 * GIB, abs=1)  # the headroom comes back


def test_an_engine_grows_only_into_memory_that_is_free_already() -> None:
    me, other = engine(1, 5), engine(2, 35)  # the other has not given back yet
    decision = move(me, [me, other], 2 * GIB + 64 * MIB)
    assert decision.target_bytes is None  # 64 MiB spare is within the band: it waits
    decision = move(me, [me, other], 10 * GIB)
    assert decision.target_bytes == 5 * GIB + 8 * GIB


def test_small_differences_and_recent_resizes_wait() -> None:
    me, other = engine(1, 20), engine(2, 20.5)
    assert move(me, [me, other], 2 * GIB).reason == "within the hysteresis band"
    me, other = engine(1, 10), engine(2, 30)
    assert move(other, [me, other], 2 * GIB, since=0.5).reason == "resized too recently"
    assert move(other, [me, other], 2 * GIB, others=0.5).reason == "another engine resized a moment ago"
    assert move(other, [me, other], 2 * GIB).target_bytes == pytest.approx(20 * GIB, abs=16)


def simulate(entries: list[EngineEntry], device_bytes: int, turns: int, noise: float, seed: int = 0):
    """Engines take turns on one device (0.5 s apart, as the server does); returns the resize times."""
    rng = random.Random(seed)
    last = {e.pid: -100.0 for e in entries}
    resizes: list[tuple[float, int]] = []
    state = {e.pid: e for e in entries}
    for turn in range(turns):
        now = turn * 0.5
        pid = entries[turn % len(entries)].pid
        me = state[pid]
        me = EngineEntry(
            **{
                **me.to_dict(),
                "demand_bytes": int(
                    entries[turn % len(entries)].demand_bytes * (1 + noise * rng.uniform(-1, 1))
                ),
            }
        )
        state[pid] = me
        used = sum(e.kv_bytes + e.headroom_bytes for e in state.values())
        others = max((last[p] for p in state if p != pid), default=-100.0)
        decision = decide(
            me,
            list(state.values()),
            device_bytes - used + sum(e.headroom_bytes for e in state.values()),
            seconds_since_resize=now - last[pid],
            seconds_since_others_resized=now - others,
            policy=POLICY,
        )
        if decision.target_bytes is not None:
            state[pid] = EngineEntry(
                **{
                    **me.to_dict(),
                    "kv_bytes": decision.target_bytes,
                    "kv_tokens": decision.target_bytes // BPT,
                }
            )
            last[pid] = now
            resizes.append((now, pid))
        assert sum(e.kv_bytes + e.headroom_bytes for e in state.values()) <= device_bytes
    return resizes, state


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_two_engines_settle_and_never_trade_memory_back_and_forth(noise: float) -> None:
    first = engine(1, 60, demand_gib=10)  # alone on the device, then a second arrives
    second = engine(2, 0.5, demand_gib=40, weight=2)
    resizes, state = simulate([first, second], 64 * GIB, turns=400, noise=noise)
    assert resizes, "they never rebalanced"
    assert all(at < 30 for at, _ in resizes), resizes  # settled within 30 s, then never moved again
    assert state[2].kv_bytes > state[1].kv_bytes  # the busier, heavier engine holds more


def test_no_engine_moves_while_another_resizes_but_an_urgent_shrink_still_happens() -> None:
    me, other = engine(1, 10), engine(2, 30, resizing=True)
    assert move(me, [me, other], 2 * GIB, others=5.0).reason == "another engine is resizing"
    assert move(me, [me, other], 0, others=5.0).urgent  # its own headroom is gone: that cannot wait
    stuck = move(me, [me, other], 2 * GIB, others=POLICY.resize_stale_s + 1)
    assert stuck.reason != "another engine is resizing"  # a resize stuck that long holds nobody


def test_a_sleeping_engine_takes_no_part_and_the_others_grow_into_what_it_freed() -> None:
    me = engine(1, 20)
    asleep = EngineEntry(2, None, "asleep", "", SLEEPING, 1.0, headroom_bytes=GIB)
    assert plan_targets([me, asleep], 22 * GIB, POLICY) == {1: 41 * GIB}  # its headroom is not kept either
    assert move(me, [me, asleep], 22 * GIB).target_bytes == 41 * GIB


def test_a_starter_and_a_running_engine_with_cached_activations_agree_on_the_shortfall() -> None:
    """The running engine's cached, unused blocks are its headroom, held on the device: counted the
    same way on both sides (`effective_free_bytes`), one shrink by the deficit is enough for the
    starter's wait (on the H200 the starter stayed 0.41 GiB short when only the running side
    added them back)."""
    from snugkv.memory_share.policy import effective_free_bytes, reserve_bytes

    running = engine(1, 100, headroom_bytes=3 * GIB, cached_bytes=GIB // 2)
    starter = EngineEntry(2, None, "e2", "", STARTING, 1.0, need_bytes=20 * GIB)
    entries = [running, starter]
    device_free = 5 * GIB - GIB // 2  # its cached blocks are held on the device
    decision = move(running, entries, effective_free_bytes(entries, device_free))
    assert decision.urgent and decision.target_bytes is not None
    given = running.kv_bytes - decision.target_bytes
    after = [engine(1, decision.target_bytes / GIB, headroom_bytes=3 * GIB, cached_bytes=GIB // 2), starter]
    spare = effective_free_bytes(after, device_free + given) - reserve_bytes(after)
    assert spare >= -POLICY.hysteresis_min_bytes


def test_running_engines_keep_room_for_a_new_engines_cuda_context() -> None:
    """Free memory below headroom plus the start room is a deficit: the engine gives it back, so a
    new engine can create its context and ask before it knows anything."""
    from snugkv.memory_share.policy import reserve_bytes

    me = engine(1, 100, headroom_bytes=GIB // 4, start_room_bytes=GIB)
    assert reserve_bytes([me]) == GIB // 4 + GIB
    decision = move(me, [me], GIB // 4)  # post-capture sizing left only its headroom free
    assert decision.urgent and decision.target_bytes == pytest.approx(99 * GIB, abs=MIB)


def test_a_waking_engine_asks_for_its_old_kv_bounded_by_its_share() -> None:
    # The other grew into everything while this one slept (pool 40 GiB, both idle, equal weights).
    sleeper = replace(engine(1, 0), state=SLEEPING)
    other = engine(2, 40)
    free = 1 * GIB  # 1 GiB free: the other's headroom only; the sleeper's own headroom is to come
    entries = [sleeper, other]
    assert wake_kv_bytes(sleeper, entries, free, 30 * GIB, POLICY) == pytest.approx(19.5 * GIB, abs=16)
    assert wake_kv_bytes(sleeper, entries, free, 4 * GIB, POLICY) == 4 * GIB  # less than its share
    assert wake_kv_bytes(sleeper, entries, free, 0, POLICY) == sleeper.min_kv_bytes  # never below its minimum
    # a busy other keeps its demand: the sleeper's share shrinks, its minimum stays
    busy = engine(2, 40, demand_gib=100)
    assert wake_kv_bytes(sleeper, [sleeper, busy], free, 30 * GIB, POLICY) == sleeper.min_kv_bytes
    # then the others treat its ask like a starting engine's: an urgent give-back of the deficit
    asking = replace(engine(1, 0), state=STARTING, need_bytes=int(19.5 * GIB) + GIB)
    decision = move(other, [asking, other], free)
    assert decision.urgent and decision.target_bytes == pytest.approx(
        other.kv_bytes - 19.5 * GIB - GIB, abs=16
    )
