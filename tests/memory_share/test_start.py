"""Elastic engines that start together split the device before they commit (`memory_share.start`):
the split itself (pure), and real processes started at the same moment on the shared host device,
each sizing a real KV pool through `size_post_capture` with the cap it agreed (as the engine does)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import snugkv.memory_share.start
from snugkv.memory.host_device import process_start_ticks
from snugkv.memory.vmm import GIB, MIB
from snugkv.memory_share.policy import SharePolicy, decide, start_cohort, start_plan
from snugkv.memory_share.record import (
    LATE,
    LOADING,
    RUNNING,
    SIZED,
    SIZING,
    STARTING,
    EngineEntry,
    ShareRecord,
)
from snugkv.memory_share.share import MemoryShare, ShareOptions
from snugkv.memory_share.start import arrived

REPO_SRC = Path(__file__).resolve().parents[2] / "src"
POLICY = SharePolicy()


def starter(
    pid: int, *, phase: str = SIZING, free_gib: float = 0.0, weight: float = 1.0, **values: Any
) -> EngineEntry:
    defaults: dict[str, Any] = dict(
        start_phase=phase,
        sizing_free_bytes=int(free_gib * GIB),
        headroom_bytes=GIB,
        min_kv_bytes=GIB // 2,
        max_kv_bytes=200 * GIB,
        start_room_bytes=GIB,
        granted=True,
    )
    return EngineEntry(pid, None, f"e{pid}", "", STARTING, weight, **{**defaults, **values})


def test_starters_split_what_is_free_at_their_sizing_points_less_every_headroom() -> None:
    first = starter(1, free_gib=101)  # arrived earlier: the second was still loading its weights
    second = starter(2, free_gib=100)
    plan = start_plan([first, second], [first, second], now=0.0)
    assert plan.free_bytes == 100 * GIB  # the last arrival's figure: every cohort weight loaded
    assert plan.reserve_bytes == 2 * GIB + GIB  # their headrooms and one start room
    assert plan.grants == {1: int(48.5 * GIB), 2: int(48.5 * GIB)}
    backed = [replace(e, kv_bytes=GIB // 4) for e in (first, second)]  # their dummy pages
    assert start_plan(backed, backed, now=0.0).grants == {1: int(48.75 * GIB), 2: int(48.75 * GIB)}


def test_the_split_keeps_the_running_engines_headroom_and_others_asks_and_follows_the_weights() -> None:
    running = EngineEntry(9, None, "old", "", RUNNING, 1.0, kv_bytes=20 * GIB, headroom_bytes=2 * GIB)
    waking = EngineEntry(8, None, "waking", "", STARTING, 1.0, need_bytes=5 * GIB)
    light, heavy = starter(1, free_gib=60), starter(2, free_gib=60, weight=3.0)
    entries = [running, waking, light, heavy]
    plan = start_plan(start_cohort(1, entries), entries, now=0.0)
    assert plan.reserve_bytes == 2 * GIB + GIB + 5 * GIB + 2 * GIB
    above_min = {pid: grant - GIB // 2 for pid, grant in plan.grants.items()}
    assert above_min[2] == pytest.approx(3 * above_min[1], rel=1e-6)
    assert sum(plan.grants.values()) == pytest.approx(60 * GIB - plan.reserve_bytes, abs=16)
    assert running.pid not in plan.grants  # the running engine rebalances later, on its turns


def test_a_member_still_loading_keeps_room_for_what_it_loads_and_gets_its_share() -> None:
    here = starter(1, free_gib=80)
    loading = starter(2, phase=LOADING, need_bytes=30 * GIB, min_kv_bytes=GIB // 2)  # 29.5 GiB to load
    plan = start_plan([here, loading], [here, loading], now=0.0)
    assert plan.pending == (2,)
    assert plan.reserve_bytes == GIB + GIB + int(29.5 * GIB)  # its headroom is in its estimate
    assert plan.grants[1] == plan.grants[2]


def test_no_rebalance_follows_the_start_split() -> None:
    first, second = starter(1, free_gib=100), starter(2, free_gib=100)
    plan = start_plan([first, second], [first, second], now=0.0)
    running = [
        replace(e, state=RUNNING, start_phase="", kv_bytes=plan.grants[e.pid], kv_tokens=0)
        for e in (first, second)
    ]
    free = 100 * GIB - sum(plan.grants.values())
    for me in running:
        move = decide(
            me, running, free, seconds_since_resize=60, seconds_since_others_resized=60, policy=POLICY
        )
        assert move.target_bytes is None, move


def test_the_starters_holds_of_the_running_engines_headroom_count_once() -> None:
    """Each starter holds the running engines' headroom while it sizes: two holders measure it
    twice gone; the figure each publishes adds back every hold, the split then keeps it once."""
    holder = starter(2, phase=LOADING, held_bytes=3 * GIB)
    me = arrived(starter(1, phase=LOADING, held_bytes=3 * GIB), [holder], free_bytes=40 * GIB)
    assert me.start_phase == SIZING and me.sizing_free_bytes == 46 * GIB


def test_a_late_starter_and_a_wake_are_not_part_of_a_cohort() -> None:
    sizing, late = starter(1), starter(2, phase=LATE)
    waking = EngineEntry(3, None, "waking", "", STARTING, 1.0, need_bytes=GIB)
    assert [e.pid for e in start_cohort(1, [sizing, late, waking])] == [1]
    assert start_cohort(2, [sizing, late, waking]) == []
    assert start_cohort(1, [replace(sizing, start_phase=SIZED)]) == []


# -- real processes on the shared host device ------------------------------------------------------

CHILD = """
import json, sys, time
import torch
from snugkv.memory.arena import KvArena
from snugkv.memory.host_device import SharedHostDevice
from snugkv.memory.kv_pool import KVPoolSpec, MHAKVPool
from snugkv.memory.vmm import MIB
from snugkv.memory.vmm_host import HostVmm
from snugkv.memory_share.record import RUNNING, EngineEntry, ShareRecord
from snugkv.memory_share.share import MemoryShare, ShareOptions
from snugkv.sizing.measure import measure_free
from snugkv.sizing.post_capture import size_post_capture

name, load_s, weight, together_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
shared = SharedHostDevice.from_env()
vmm = HostVmm(granularity_bytes=2 * MIB, capacity_bytes=1 << 40, shared=shared)
spec = KVPoolSpec.of(dtype="float32", page_size=16, layout="hnd", device="cpu", mode="post-capture")
pool = MHAKVPool(spec, reserved_tokens=1_000_000, num_layers=4, num_kv_heads=2, head_dim=64,
                 arena=KvArena(vmm, 64 * 1024 * MIB, label=name))
pool.ensure_prefix()  # the dummy page, as before graph capture
per_token = int(pool.bytes_per_token)
min_tokens = 1024
print("READY", flush=True)
sys.stdin.readline()  # every child goes at once

entry = EngineEntry.of_this_process(name, weight, need_bytes=min_tokens * per_token, bytes_per_token=per_token,
                                    min_kv_bytes=min_tokens * per_token)
options = ShareOptions(weight=weight, min_tokens=min_tokens, start_together_s=together_s)
share = MemoryShare(ShareRecord.for_device("host"), entry, torch.device("cpu"), options)
share._wait_for_memory()
time.sleep(load_s)  # loading weights and capturing graphs (the others register meanwhile)
free = measure_free(vmm)
agreeing = time.monotonic()
cap = share.agree_start_kv(free.min_bytes, pool.committed_bytes, shared.headroom_bytes, per_token,
                           pool.bytes_for_tokens(pool.reserved_tokens))
agreed_s = time.monotonic() - agreeing
sized = size_post_capture(pool, free, shared.headroom_bytes, kv_cap_bytes=cap)
share.entry = share.entry.beat(state=RUNNING, start_phase="", kv_bytes=pool.committed_bytes,
                               kv_tokens=sized.max_total_num_tokens, headroom_bytes=shared.headroom_bytes)
share.record.publish(share.entry)
print(json.dumps({"name": name, "cap": cap, "committed": pool.committed_bytes, "retries": sized.retries,
                  "agreed_s": agreed_s}), flush=True)
sys.stdin.read()  # hold the memory until the test ends
"""

DEVICE_GIB = 0.5
HEADROOM_MIB = 8


def start_together(runtime: Path, engines: list[tuple[float, float]], together_s: float = 30.0) -> list[dict]:
    """Start one child per (load seconds, weight), let them all go at the same moment, and return
    what each sized (the children keep their memory until they are closed)."""
    env = {
        "SNUGKV_RUNTIME_DIR": str(runtime),
        "PYTHONPATH": str(REPO_SRC),
        "SNUGKV_HOST_DEVICE_GIB": str(DEVICE_GIB),
        "SNUGKV_HOST_DEVICE_HEADROOM_MIB": str(HEADROOM_MIB),
    }
    script = textwrap.dedent(CHILD)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", script, f"e{i}", str(load_s), str(weight), str(together_s)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i, (load_s, weight) in enumerate(engines)
    ]
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline().strip() == "READY"
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        results = []
        for child in children:
            assert child.stdout is not None
            line = child.stdout.readline()
            assert line, f"a child failed (exit {child.wait()})"
            results.append(json.loads(line))
        return results
    finally:
        for child in children:
            child.kill()
            child.wait()


def assert_even(results: list[dict]) -> None:
    committed = [r["committed"] for r in results]
    mean = sum(committed) / len(committed)
    assert all(abs(value - mean) <= 0.10 * mean for value in committed), committed
    assert sum(committed) + len(committed) * HEADROOM_MIB * MIB <= DEVICE_GIB * GIB
    assert sum(committed) >= 0.85 * DEVICE_GIB * GIB  # the device is used, not left idle


@pytest.mark.slow
@pytest.mark.parametrize("loads", [(0.3, 0.3), (0.3, 0.45, 0.6)], ids=["two", "three"])
def test_engines_started_at_the_same_moment_split_the_device_evenly_with_no_retry(
    tmp_path: Path, loads: tuple[float, ...]
) -> None:
    results = start_together(tmp_path, [(load_s, 1.0) for load_s in loads])
    assert_even(results)
    assert all(r["cap"] is not None for r in results)  # each committed by the plan
    assert [r["retries"] for r in results] == [0] * len(loads)
    # each waited at its sizing point only for the slowest to load, not seconds more
    assert max(r["agreed_s"] for r in results) < max(loads) + 1.0


@pytest.mark.slow
def test_weights_shape_the_start_split(tmp_path: Path) -> None:
    light, heavy = start_together(tmp_path, [(0.3, 1.0), (0.3, 3.0)])
    minimum = 1024 * 4096  # the children's --kv-min-tokens of 4 KiB tokens
    assert heavy["cap"] - minimum == pytest.approx(3 * (light["cap"] - minimum), rel=1e-3)
    for child in (light, heavy):  # each backs its cap less at most one granule per buffer
        assert child["cap"] - 8 * 2 * MIB <= child["committed"] <= child["cap"]
        assert child["retries"] == 0


@pytest.mark.slow
def test_a_starter_slower_than_the_wait_limit_still_gets_its_share(tmp_path: Path) -> None:
    results = start_together(tmp_path, [(0.3, 1.0), (0.3, 1.0), (2.0, 1.0)], together_s=0.4)
    assert_even(results)
    fast = [r["agreed_s"] for r in results[:2]]
    assert max(fast) < 1.0  # they stopped waiting at the limit, not when the slow one arrived
    assert [r["retries"] for r in results] == [0, 0, 0]


# -- one engine alone, and an engine that arrives while others size ---------------------------------


@pytest.fixture()
def record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ShareRecord:
    monkeypatch.setenv("SNUGKV_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("SNUGKV_HOST_DEVICE_GIB", "1")
    return ShareRecord.for_device("host")


def share_of_this_process(record: ShareRecord, **options: Any) -> MemoryShare:
    entry = EngineEntry.of_this_process(
        "me", 1.0, need_bytes=64 * MIB, bytes_per_token=MIB, min_kv_bytes=64 * MIB
    )
    return MemoryShare(record, entry, torch.device("cpu"), ShareOptions(min_tokens=64, **options))


def test_an_engine_starting_alone_sizes_as_before_without_waiting(
    record: ShareRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    share = share_of_this_process(record)
    share._wait_for_memory()
    assert share.entry.start_phase == LOADING and share.entry.granted
    polls: list[float] = []  # the wait for a cohort sleeps between reads of the record: none here
    monkeypatch.setattr(snugkv.memory_share.start.time, "sleep", polls.append)
    assert share.agree_start_kv(GIB, 0, 0, MIB, GIB) is None  # no cap: all free memory, as before
    assert polls == []
    assert share.entry.start_phase == SIZED


def test_an_engine_that_registers_while_another_sizes_waits_for_it_to_run_then_asks(
    record: ShareRecord,
) -> None:
    other_process = subprocess.Popen(["sleep", "60"])
    try:
        pid = other_process.pid
        other = replace(
            starter(pid, free_gib=1.0),
            start_ticks=process_start_ticks(pid),
            headroom_bytes=0,
            start_room_bytes=0,
        )
        record.publish(other)  # at its sizing point: it counts on the free memory
        share = share_of_this_process(record)
        waiting = threading.Thread(target=share._wait_for_memory)
        waiting.start()
        time.sleep(0.3)
        mine = next(e for e in record.entries() if e.pid == share.entry.pid)
        assert mine.start_phase == LATE and not mine.granted
        assert [e.pid for e in start_cohort(pid, record.entries())] == [pid]  # not in its cohort
        record.publish(replace(other, state=RUNNING, start_phase="", kv_bytes=GIB // 2))
        waiting.join(timeout=5)
        assert not waiting.is_alive()
        assert share.entry.granted and share.entry.start_phase == LOADING  # a cohort of its own now
    finally:
        other_process.kill()
        other_process.wait()
