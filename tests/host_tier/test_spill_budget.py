"""A pressure move's spill budget: a time at the host tier's measured write bandwidth becomes whole
pages; a move that has one writes copies parents first (the most recently used first) until it is
spent and drops the rest; a copy is never made under a parent that is dropped. A move without one
(a resize, sleep) keeps everything the host tier holds."""

from __future__ import annotations

import pytest

from snugkv.engine import EngineArgs
from snugkv.engine.args import InvalidEngineArgs
from snugkv.memory.host_tier import HostCopies
from snugkv.scheduler.radix_cache import SpillBudget
from tests.host_tier.test_cache_tiers import Tiers, sequence


def test_a_time_budget_becomes_whole_pages_at_the_measured_bandwidth_and_none_without_one():
    tiers = Tiers(4, "nhd", device_tokens=32, host_tokens=32, copies=HostCopies())
    assert tiers.tier.spill_tokens_within(1.0) is None  # not measured: no budget
    assert tiers.cache.spill_budget(0.5) is None
    tiers.tier.write_bytes_per_s = 10 * tiers.tier.page_bytes  # ten pages a second
    assert tiers.tier.spill_tokens_within(0.25) == 2 * 4  # 2.5 pages: two whole ones
    assert tiers.tier.spill_tokens_within(0.0) == 0
    assert tiers.cache.spill_budget(0.5) == SpillBudget(5 * 4)
    assert tiers.cache.spill_budget(None) is None  # a resize or sleep: no limit


def test_the_start_up_probe_times_real_page_writes_and_gives_its_pages_back():
    tiers = Tiers(4, "nhd", device_tokens=32, host_tokens=32, copies=HostCopies())
    bytes_per_s = tiers.tier.probe_write_bytes_per_s(device_pages=8)
    assert bytes_per_s is not None and bytes_per_s > 0
    assert tiers.tier.used_pages == 0 and tiers.tier.traffic().bytes_to_host > 0
    assert tiers.tier.probe_write_bytes_per_s(device_pages=0) is None


def test_a_spill_budget_keeps_the_most_recent_entries_parents_first_and_drops_the_rest():
    tiers = Tiers(4, "nhd", device_tokens=32, host_tokens=32, copies=HostCopies())
    system = sequence(9)
    a, b, c = [*system, *sequence(1)], [*system, *sequence(2)], sequence(3)
    for request in (a, b, c):  # the tree: system -> (a's rest, b's rest), and c
        tiers.serve(request)
    cache = tiers.cache
    budget = SpillBudget(16)  # two of the four 8-token entries
    assert cache.evict(cache.cached_tokens, budget) == 32
    # c (the most recent) and the shared system prompt are kept; a's and b's rests are dropped
    assert cache.spilled_tokens == 16 and cache.dropped_tokens == 16 and budget.tokens == 0
    assert cache.budget_dropped_tokens == 16
    tiers.check()
    assert tiers.serve(c) == (0, 8)
    assert tiers.serve(a) == (0, 8)  # the system prompt from the host tier, a's rest computed again
    tiers.check()


def test_no_copy_is_made_under_a_parent_the_budget_drops():
    tiers = Tiers(4, "nhd", device_tokens=32, host_tokens=32, copies=HostCopies())
    system = sequence(9)
    for rest in (1, 2):
        tiers.serve([*system, *sequence(rest, length=4)])
    cache = tiers.cache
    budget = SpillBudget(4)  # room for either 4-token child, not for their 8-token parent
    assert cache.evict(cache.cached_tokens, budget) == 16
    assert cache.spilled_tokens == 0 and cache.host_cached_tokens == 0 and budget.tokens == 4
    assert cache.dropped_tokens == cache.budget_dropped_tokens == 16
    tiers.check()


def test_without_a_budget_every_entry_the_host_tier_holds_is_kept():
    tiers = Tiers(4, "nhd", device_tokens=32, host_tokens=32, copies=HostCopies())
    tiers.tier.write_bytes_per_s = 1.0  # a budget of seconds would spill nothing: none is given
    for first in (1, 2, 3):
        tiers.serve(sequence(first))
    assert tiers.cache.evict_at_or_above(0) == 24
    assert tiers.cache.spilled_tokens == 24 and tiers.cache.dropped_tokens == 0
    tiers.check()


@pytest.mark.parametrize("value", [-1.0, float("nan")])
def test_a_negative_spill_budget_is_refused_naming_the_flag(value):
    with pytest.raises(InvalidEngineArgs, match="--kv-pressure-spill-ms"):
        EngineArgs.of(kv_pressure_spill_ms=value)
