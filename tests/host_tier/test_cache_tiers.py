"""The prefix cache over two tiers, on a small CPU pool: what leaves the device is written to the
host tier and loads back bit for bit, the host tier evicts least recently used, no device page is
reused before its copy ran, and every slot and host page is accounted for."""

from __future__ import annotations

import pytest
import torch

from snugkv.memory.allocator import make_allocator
from snugkv.memory.arena import KvArena
from snugkv.memory.host_tier import HostCopies, HostKvTier, PageCopies
from snugkv.memory.kv_pool import KVPoolSpec, MHAKVPool
from snugkv.memory.layout import KVLayout
from snugkv.memory.vmm import MIB
from snugkv.memory.vmm_host import HostVmm
from snugkv.scheduler.radix_cache import RadixCache
from tests.host_tier.held_copies import HeldCopies, staging_for

LAYERS, HEADS, DIM = 2, 2, 4


class Tiers:
    """A pool, its allocator, a host tier and the prefix cache over them; `serve` runs one request
    as the scheduler would (match, load back, compute the rest, insert). `path`: the tier's copies,
    "batched" (the engine's, here through a staging of one page: every page is a chunk) or "per-run"."""

    def __init__(
        self,
        page_size: int,
        layout: str,
        device_tokens: int,
        host_tokens: int,
        copies: PageCopies,
        path: str = "batched",
    ):
        spec = KVPoolSpec.of(dtype="float32", page_size=page_size, layout=layout, device="cpu", mode="static")
        arena = KvArena(HostVmm(granularity_bytes=64 * 1024), 64 * MIB, label="test")
        self.pool = MHAKVPool(
            spec,
            reserved_tokens=device_tokens,
            num_layers=LAYERS,
            num_kv_heads=HEADS,
            head_dim=DIM,
            arena=arena,
        )
        self.page = page_size
        self.allocator = make_allocator(device_tokens, page_size)
        views = self.pool.page_views()
        staging = staging_for(1, sum(view.shape[1] for view in views)) if path == "batched" else None
        self.tier = HostKvTier(
            views, num_pages=host_tokens // page_size, page_size=page_size, copies=copies, pin_memory=False,
            staging=staging,
        )  # fmt: skip
        self.cache = RadixCache(self.allocator, host_tier=self.tier)

    def kv(self, tokens: list[int], start: int, layer: int) -> torch.Tensor:
        values = torch.tensor([t * 1000 + p + layer / 4 for p, t in enumerate(tokens)], dtype=torch.float32)
        return values[start:, None, None].expand(-1, HEADS, DIM)

    def read(self, buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if self.pool.layout is KVLayout.PAGE_MAJOR:
            return buffer[slots // self.page, :, slots % self.page]
        return buffer[slots]

    def assert_holds(self, tokens: list[int], slots: torch.Tensor) -> None:
        for layer in range(LAYERS):
            k, v = self.pool.get_kv_buffer(layer)
            expected = self.kv(tokens[: slots.numel()], 0, layer)
            assert torch.equal(self.read(k, slots), expected) and torch.equal(self.read(v, slots), -expected)

    def serve(self, tokens: list[int], *, abort: bool = False) -> tuple[int, int]:
        """One request: returns (tokens served from the device, from the host tier)."""
        cache, allocator = self.cache, self.allocator
        hits_before = cache.host_hit_tokens
        match = cache.match_prefix(tokens)
        device_hit = match.num_tokens
        if match.host_nodes:
            match = cache.load_back(match)
        cache.lock(match.node)
        if abort:  # ends before its prefill: the load may still be on its way
            cache.unlock(match.node)
            return device_hit, cache.host_hit_tokens - hits_before
        if isinstance(self.tier.copies, HeldCopies):
            self.tier.copies.flush()  # the prefill's forward runs after the load (a GPU orders it so)
        self.assert_holds(tokens, match.slots)
        need = -(-(len(tokens) - match.num_tokens) // self.page) * self.page
        if allocator.available_tokens < need:
            cache.evict(need - allocator.available_tokens)
        new = allocator.alloc(need)
        assert new is not None
        slots = torch.cat([match.slots, new])[: len(tokens)]
        for layer in range(LAYERS):
            computed = self.kv(tokens, match.num_tokens, layer)
            self.pool.set_kv(layer, slots[match.num_tokens :], computed, -computed)
        cache.unlock(match.node)
        existing = cache.insert(tokens, slots)
        usable = len(tokens) // self.page * self.page
        for part in (slots[match.num_tokens : existing], new[usable - match.num_tokens :]):
            if part.numel():
                allocator.free(part)
        return device_hit, cache.host_hit_tokens - hits_before

    def check(self) -> None:
        """Nothing locked: every device slot is free or cached; every host page is the cache's."""
        assert self.allocator.available_tokens + self.cache.cached_tokens == self.allocator.capacity_tokens
        self.allocator.check_integrity()
        self.cache.check_host_tier()


def sequence(first: int, length: int = 8) -> list[int]:
    return [first * 100 + index for index in range(length)]


@pytest.mark.parametrize("path", ["batched", "per-run"])
@pytest.mark.parametrize(("page_size", "layout"), [(1, "nhd"), (4, "nhd"), (4, "hnd")])
def test_a_prefix_evicted_from_the_device_is_served_from_the_host_tier_bit_for_bit(page_size, layout, path):
    tiers = Tiers(page_size, layout, device_tokens=16, host_tokens=32, copies=HostCopies(), path=path)
    a, b, c = sequence(1), sequence(2), sequence(3)
    assert tiers.serve(a) == (0, 0)
    tiers.serve(b)
    tiers.serve(c)  # the device holds two: a leaves for the host tier
    assert tiers.cache.spilled_tokens == 8 and tiers.cache.host_cached_tokens == 8
    tiers.check()
    assert tiers.serve([*a, 7, 7, 7, 7]) == (0, 8)  # a's KV came back from the host tier (assert_holds)
    stats = tiers.cache.host_tier_stats()
    assert (
        stats is not None
        and stats.host_hit_tokens == 8
        and stats.bytes_to_device == 8 * tiers.tier.page_bytes // page_size
    )
    tiers.check()


def test_the_host_tier_evicts_least_recently_used_and_drops_what_is_older_than_all_it_holds():
    tiers = Tiers(4, "nhd", device_tokens=16, host_tokens=16, copies=HostCopies())
    a, b, c, d, e = (sequence(n) for n in range(1, 6))
    for request in (a, b, c, d):  # a and b leave the device: the host tier is full
        tiers.serve(request)
    assert tiers.cache.host_cached_tokens == 16
    tiers.serve(e)  # c leaves the device; a, used before it, leaves the host tier
    assert tiers.cache.match_prefix(a).host_nodes == ()
    assert tiers.cache.match_prefix(a).num_tokens == 0
    assert tiers.serve(b) == (0, 8)  # b is still in the host tier
    tiers.check()
    assert tiers.cache.dropped_tokens == 0 and tiers.tier.used_pages == 4


@pytest.mark.parametrize("path", ["batched", "per-run"])
def test_a_device_page_is_not_reused_before_its_write_to_the_host_ran(path):
    copies = HeldCopies()
    tiers = Tiers(4, "nhd", device_tokens=16, host_tokens=32, copies=copies, path=path)
    freed_with_copies_pending: list[int] = []
    free = tiers.allocator.free

    def watched_free(slots):
        freed_with_copies_pending.append(copies.pending)
        free(slots)

    tiers.allocator.free = watched_free  # type: ignore[method-assign]
    a, b, c = sequence(1), sequence(2), sequence(3)
    tiers.serve(a)
    tiers.serve(b)
    tiers.serve(c)  # a's pages are written out, then reused by c
    assert copies.ran == 1 and max(freed_with_copies_pending) == 0
    assert tiers.serve(a) == (0, 8)  # the bytes written are a's, not c's
    tiers.check()


@pytest.mark.parametrize("path", ["batched", "per-run"])
def test_slots_a_load_fills_are_not_reused_before_it_ends_when_its_request_is_aborted(path):
    copies = HeldCopies()
    tiers = Tiers(4, "nhd", device_tokens=16, host_tokens=32, copies=copies, path=path)
    a, b, c = sequence(1), sequence(2), sequence(3)
    for request in (a, b, c):
        tiers.serve(request)
    copies.flush()
    assert tiers.serve(a, abort=True) == (0, 8)  # a is loading; its request is aborted
    assert copies.pending == 1
    tiers.check()  # no slot leaked: the loading pages are the cache's
    tiers.cache.evict(tiers.cache.cached_tokens)  # everything leaves the device, a's pages too
    assert copies.pending == 0  # the load ran before its slots went back to the allocator
    tiers.check()
    assert tiers.serve(a) == (0, 8)
    tiers.check()


def test_a_request_that_computed_a_host_only_prefix_again_puts_its_slots_back_in_the_cache():
    tiers = Tiers(4, "nhd", device_tokens=16, host_tokens=32, copies=HostCopies())
    a, b, c = sequence(1), sequence(2), sequence(3)
    for request in (a, b, c):
        tiers.serve(request)
    tiers.cache.evict(8)  # room for a request that computes a without the cache (it scores its prompt)
    slots = tiers.allocator.alloc(8)
    assert slots is not None
    for layer in range(LAYERS):
        computed = tiers.kv(a, 0, layer)
        tiers.pool.set_kv(layer, slots, computed, -computed)
    assert tiers.cache.insert(a, slots) == 0  # the cache took all of them: a is on the device again
    assert tiers.serve(a) == (8, 0)
    assert tiers.cache.host_cached_tokens == 16  # its host copy stays, beside b's
    tiers.check()


def test_a_shrink_spills_what_lies_above_its_bound_and_reset_drops_both_tiers():
    tiers = Tiers(4, "nhd", device_tokens=16, host_tokens=32, copies=HostCopies())
    a, b = sequence(1), sequence(2)
    tiers.serve(a)
    tiers.serve(b)
    first_of_b = int(tiers.cache.match_prefix(b).slots.min())
    assert tiers.cache.evict_at_or_above(first_of_b) == 8
    assert tiers.cache.match_prefix(a).num_tokens == 8 and tiers.cache.host_cached_tokens == 8
    tiers.check()
    tiers.cache.spill_all()
    assert tiers.cache.cached_tokens == 0 and tiers.cache.host_cached_tokens == 16
    tiers.cache.reset()
    assert tiers.cache.host_cached_tokens == 0 and tiers.tier.used_pages == 0
    assert tiers.cache.match_prefix(a).host_nodes == ()
    tiers.check()


def test_a_host_tier_too_small_for_an_entry_drops_it():
    tiers = Tiers(4, "nhd", device_tokens=16, host_tokens=4, copies=HostCopies())
    for request in (sequence(1), sequence(2), sequence(3)):
        tiers.serve(request)
    assert tiers.cache.dropped_tokens == 8 and tiers.cache.host_cached_tokens == 0
    tiers.check()


def test_an_eviction_for_room_into_the_host_tier_frees_a_batch_not_a_page() -> None:
    """With a host tier every eviction writes and waits: one for a request's room frees at least
    `eviction_floor` tokens (here 1/16 of the cache: the pages are tiny) so that a page short per
    step is not a copy and a host wait per step; what leaves is still served back from the host
    tier. A budgeted eviction (a pressure move's) frees what it is asked for only."""
    tiers = Tiers(4, "nhd", device_tokens=1024, host_tokens=2048, copies=HostCopies())
    prompts = [[1000 * index + token for token in range(4)] for index in range(40)]  # one page each
    for prompt in prompts:
        tiers.serve(prompt)
    cache = tiers.cache
    assert cache.eviction_floor() == 64  # 1024 / 16
    assert cache.evict(1) == 4  # asked one page's worth: one entry
    assert cache.evict_for_room(1) == 64 and cache.dropped_tokens == 0  # sixteen entries, all spilled
    assert tiers.serve(prompts[1]) == (0, 4)  # among the least recently used: back from the host tier
    assert RadixCache(tiers.allocator).eviction_floor() == 0  # no tier: evictions free what is asked


@pytest.mark.parametrize("page_size", [1, 4])
def test_multi_turn_sessions_through_both_tiers_keep_every_index_and_slot_right(page_size) -> None:
    """Sessions that re-send their history, more of them than both tiers hold, and evictions of
    random sizes between: the cache's kept indexes (device leaves, host copies) match a walk of the
    tree after every request, and every hit is served bit for bit (`serve` checks the KV)."""
    import random

    rng = random.Random(page_size)
    tiers = Tiers(page_size, "nhd", device_tokens=96, host_tokens=128, copies=HostCopies())
    histories: list[list[int]] = [[] for _ in range(12)]
    host_hits = 0
    for turn in range(6):
        for session in rng.sample(range(len(histories)), len(histories)):
            turn_tokens = [session * 1000 + turn * 10 + index for index in range(rng.randrange(3, 10))]
            histories[session] = histories[session] + turn_tokens
            host_hits += tiers.serve(histories[session])[1]
            tiers.check()
            if rng.random() < 0.2:
                tiers.cache.evict(rng.randrange(1, 24))
                tiers.check()
    assert host_hits > 0 and tiers.cache.spilled_tokens > tiers.tier.capacity_tokens  # the tier filled


def test_a_full_host_tier_frees_a_batch_of_its_oldest_entries_at_once() -> None:
    """When the host tier is full, room for a newcomer drops 1/64 of the tier at once (least
    recently used first), not just the newcomer's pages, so that its scan of the entries is not
    paid for every page that comes in."""
    tiers = Tiers(1, "nhd", device_tokens=8, host_tokens=1024, copies=HostCopies())
    prompts = [[1000 * index, 1000 * index + 1] for index in range(520)]  # one entry of 2 pages each
    for prompt in prompts[:516]:  # the device holds 4; 512 went to the host tier: full
        tiers.serve(prompt)
    assert tiers.tier.free_pages == 0 and tiers.cache.host_cached_tokens == 1024
    tiers.serve(prompts[516])  # one more entry leaves the device: 16 pages freed (1024 / 64), 2 used
    tiers.check()
    assert tiers.tier.free_pages == 14 and tiers.cache.host_cached_tokens == 1024 - 14
    assert tiers.cache.dropped_tokens == 0  # the newcomer was kept; the 8 oldest entries left the tier
    assert all(tiers.cache.match_prefix(prompt).host_nodes == () for prompt in prompts[:8])
    assert tiers.cache.match_prefix(prompts[8]).host_nodes != ()
