"""The host tier in a real engine: SmolLM2 (the embedded model) on CPU with a small 'device' KV
cache (the host backend) and a host tier beside it. Greedy outputs are those of the same engine
without the tier; a prefix pushed off the device comes back from the host tier (its counters say
so); a request aborted while its prefix loads leaks nothing; a resize shrink and sleep level 1
move cached prefixes to the host tier instead of dropping them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from snugkv.core.reports import SlotAccounting
from snugkv.core.sampling import SamplingParams
from snugkv.driver.engine_core import EngineCore
from snugkv.engine import Engine, EngineArgs
from snugkv.memory.tier_copies import STAGING_BYTES
from snugkv.scheduler import elastic
from snugkv.scheduler.scheduler import Scheduler
from tests.host_tier.held_copies import HeldCopies

PAGE = 4
DEVICE_TOKENS = 384  # the 'device' holds about four of the prompts below
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    args = EngineArgs.of(
        dtype="float32",
        max_total_tokens=DEVICE_TOKENS,
        max_running_requests=4,
        chunked_prefill_size=128,
        page_size=PAGE,
        kv_chunk_mib=1 / 16,  # 64 KiB extensions: a shrink gives back what it is asked for
        kv_host_tier_gib=0.05,  # about 1,100 tokens of SmolLM2's float32 KV
    )
    started = Engine(args)
    assert started.host_tier is not None
    yield started
    started.close()


def sessions(count: int, length: int = 80) -> list[list[int]]:
    """Prompts that share a 16-token system prompt, then differ."""
    system = [1, *range(500, 515)]
    return [system + [(977 * s + 31 * i) % 40000 + 100 for i in range(length - 16)] for s in range(count)]


def core_of(engine: Engine, *, host_tier: bool = True) -> tuple[EngineCore, dict[str, list[int]]]:
    outputs: dict[str, list[int]] = {}
    core = EngineCore.around(
        engine,
        use_host_tier=host_tier,
        on_output=lambda request, output: outputs.setdefault(output.rid, []).extend(output.token_ids),
    )
    return core, outputs


def run(scheduler: Scheduler, prompts: list[list[int]], tag: str) -> list[str]:
    """One request per prompt, one after another (each finds the cache the one before left)."""
    rids = []
    for index, prompt in enumerate(prompts):
        rid = f"{tag}-{index}"
        sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        scheduler.add_request(rid, prompt, sampling)
        while scheduler.has_work:
            scheduler.step()
        rids.append(rid)
    scheduler.check_slot_accounting()
    return rids


def done(scheduler: Scheduler) -> None:
    """Leave the engine as the next test expects it: no cache entries in either tier."""
    scheduler.check_slot_accounting()
    scheduler.cache.reset()
    assert scheduler.cache.host_cached_tokens == 0


def test_greedy_outputs_with_the_host_tier_equal_those_without_and_hits_come_from_the_host(engine):
    prompts = sessions(8)
    order = prompts + prompts[:4]  # the first four come back once the device forgot them
    without, expected = core_of(engine, host_tier=False)
    run(without.scheduler, order, "off")
    assert without.scheduler.cache.host_cached_tokens == 0
    done(without.scheduler)
    core, outputs = core_of(engine)
    run(core.scheduler, order, "on")
    assert [outputs[f"on-{i}"] for i in range(len(order))] == [
        expected[f"off-{i}"] for i in range(len(order))
    ]
    stats = core.scheduler.stats().host_tier
    assert stats is not None
    assert stats.spilled_tokens > 0 and stats.bytes_to_host > 0
    # each returning prompt: its 76 tokens in whole pages, the shared 16 from the device, 60 from the host
    assert stats.host_hit_tokens == 4 * 60
    assert stats.bytes_to_device > 0 and stats.load_s > 0
    done(core.scheduler)


def test_a_request_whose_prefix_is_loading_can_be_aborted_and_nothing_leaks(engine):
    core, outputs = core_of(engine)
    scheduler = core.scheduler
    prompts = sessions(6)
    run(scheduler, prompts, "warm")  # the first ones are in the host tier now
    assert scheduler.cache.match_prefix(prompts[0], count_stats=False).host_nodes
    tier = engine.host_tier
    assert tier is not None
    copies, held = tier.copies, HeldCopies()
    tier.copies = held
    try:
        sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        scheduler.add_request("aborted", prompts[0], sampling)
        scheduler.step()  # admitted: its prefix is on its way back from the host tier
        assert held.pending == 1
        scheduler.abort("aborted")
        while scheduler.has_work:
            scheduler.step()
        scheduler.check_slot_accounting()  # its slots are back, the loading pages are the cache's
        scheduler.cache.evict(scheduler.cache.evictable_tokens)  # their slots wait for the load
        assert held.pending == 0
    finally:
        tier.copies = copies
    scheduler.check_slot_accounting()
    run(scheduler, [prompts[0]], "again")
    assert outputs["again-0"] == outputs["warm-0"]
    done(scheduler)


def test_a_resize_shrink_moves_cached_prefixes_to_the_host_tier(engine):
    core, outputs = core_of(engine)
    scheduler = core.scheduler
    prompts = sessions(4)
    run(scheduler, prompts, "before")
    spilled = scheduler.cache.spilled_tokens
    change = elastic.resize_kv(scheduler, engine, max_total_num_tokens=96)
    assert change.to_tokens == 96 and change.evicted_tokens > 0
    assert scheduler.cache.spilled_tokens - spilled == change.evicted_tokens  # all of it, none dropped
    assert scheduler.cache.dropped_tokens == 0
    elastic.resize_kv(scheduler, engine, max_total_num_tokens=DEVICE_TOKENS)
    hits = scheduler.cache.host_hit_tokens
    run(scheduler, prompts, "after")
    assert scheduler.cache.host_hit_tokens - hits >= 4 * 60
    assert [outputs[f"after-{i}"] for i in range(4)] == [outputs[f"before-{i}"] for i in range(4)]
    done(scheduler)


def test_a_pressure_shrink_spills_only_what_its_time_budget_writes_and_records_the_rest_as_dropped(engine):
    core, _ = core_of(engine)
    scheduler = core.scheduler
    run(scheduler, sessions(4), "before")
    tier = engine.host_tier
    assert tier is not None and tier.write_bytes_per_s is not None  # measured at start-up
    measured = tier.write_bytes_per_s
    tier.write_bytes_per_s = 20 * tier.page_bytes  # 20 pages a second: 0.5 s carries 10 pages
    spilled = scheduler.cache.spilled_tokens
    try:
        room = elastic.make_room(scheduler, 96, spill_budget_s=0.5)
    finally:
        tier.write_bytes_per_s = measured
    assert room.evicted_tokens > 10 * PAGE
    assert scheduler.cache.spilled_tokens - spilled <= 10 * PAGE
    assert room.dropped_tokens >= room.evicted_tokens - 10 * PAGE and room.took_ms > 0
    change = engine.resize_kv(
        engine.kv.target(96),
        on_move=lambda moves: scheduler.cache.remap_slots(moves.full),
        evicted_tokens=room.evicted_tokens,
        dropped_tokens=room.dropped_tokens,
        room_ms=room.took_ms,
        reason="pressure",
    )
    assert change.to_dict()["dropped_tokens"] == room.dropped_tokens
    assert f"({room.dropped_tokens} dropped" in change.log_line()
    elastic.resize_kv(scheduler, engine, max_total_num_tokens=DEVICE_TOKENS)
    done(scheduler)


def test_sleep_level_1_keeps_the_prefix_cache_in_the_host_tier_and_wake_serves_it(engine):
    core, outputs = core_of(engine)
    scheduler = core.scheduler
    prompts = sessions(2)
    run(scheduler, prompts, "before")
    elastic.sleep(scheduler, engine, level=1)
    assert scheduler.cache.cached_tokens == 0 and scheduler.cache.host_cached_tokens >= 2 * 76
    elastic.wake_up(scheduler, engine)
    hits = scheduler.cache.host_hit_tokens
    run(scheduler, prompts, "after")
    assert scheduler.cache.host_hit_tokens - hits >= 2 * 60
    assert [outputs[f"after-{i}"] for i in range(2)] == [outputs[f"before-{i}"] for i in range(2)]
    done(scheduler)


def test_the_ledger_and_the_stats_show_the_host_tier(engine):
    core, _ = core_of(engine)
    tier = engine.host_tier
    assert tier is not None
    assert engine.report.ledger.host_tier_bytes == tier.capacity_bytes
    # the engine copies through its fixed staging (on CPU general RAM: not a row of the ledger)
    assert tier.path.name == "batched" and tier.staging_bytes == STAGING_BYTES
    assert engine.report.ledger.host_tier_staging_bytes == 0
    assert "KV host tier" in engine.report.ledger.table()
    stats = core.scheduler.stats().to_dict()["host_tier"]
    assert stats["capacity_tokens"] == tier.capacity_tokens and stats["pinned"] is False
    info = core.info(model_name="m", step_errors=0, aborted_rids=(), slot_accounting=SlotAccounting())
    assert info.to_dict()["stats"]["host_tier"]["capacity_bytes"] == tier.capacity_bytes
