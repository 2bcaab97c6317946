"""Prefix cache: page-aligned matches, insert ownership, LRU eviction of unlocked leaves."""

from __future__ import annotations

import random

import pytest
import torch

from snugkv.memory.allocator import PagedAllocator, TokenAllocator
from snugkv.scheduler.radix_cache import RadixCache


def make_cache(page_size: int, capacity: int = 4096) -> RadixCache:
    allocator = TokenAllocator(capacity) if page_size == 1 else PagedAllocator(capacity, page_size)
    return RadixCache(allocator)


def cache_request(cache: RadixCache, tokens: list[int]) -> torch.Tensor:
    """What the scheduler does for one finished request: reuse, compute the rest, insert."""
    match = cache.match_prefix(tokens)
    new = cache.allocator.alloc(-(-(len(tokens) - match.num_tokens) // cache.page_size) * cache.page_size)
    assert new is not None
    slots = torch.cat([match.slots, new])[: len(tokens)]
    existing = cache.insert(tokens, slots)
    usable = len(tokens) // cache.page_size * cache.page_size
    duplicates = slots[match.num_tokens : existing]
    if duplicates.numel():
        cache.allocator.free(duplicates)
    leftover = new[usable - match.num_tokens :]
    if leftover.numel():
        cache.allocator.free(leftover)
    return slots


@pytest.mark.parametrize("page_size", [1, 4])
def test_shared_prefix_is_reused_page_aligned(page_size):
    cache = make_cache(page_size)
    first = cache_request(cache, list(range(10)))
    match = cache.match_prefix([*range(6), 99, 100, 101])
    expected = 6 // page_size * page_size
    assert match.num_tokens == expected
    assert torch.equal(match.slots, first[:expected])


def test_second_identical_request_hits_every_cached_page():
    cache = make_cache(4)
    cache_request(cache, list(range(16)))
    cache.hit_tokens = cache.query_tokens = 0
    assert cache.match_prefix(list(range(16))).num_tokens == 16
    assert cache.hit_rate == 1.0


def test_locked_prefix_survives_eviction_and_unlocked_leaves_go_lru():
    cache = make_cache(1, capacity=64)
    cache_request(cache, [1, 2, 3, 4])
    cache_request(cache, [7, 8, 9])
    match = cache.match_prefix([1, 2, 3, 4])
    cache.lock(match.node)
    freed = cache.evict(100)
    assert freed == 3 and cache.cached_tokens == 4
    assert cache.match_prefix([7, 8, 9]).num_tokens == 0
    cache.unlock(match.node)
    assert cache.evict(100) == 4
    assert cache.allocator.available_tokens == 64


def test_unlocking_more_than_locking_is_an_error():
    cache = make_cache(1)
    cache_request(cache, [1, 2, 3])
    node = cache.match_prefix([1, 2, 3]).node
    cache.lock(node)
    cache.unlock(node)
    with pytest.raises(RuntimeError, match="unlocked more often"):
        cache.unlock(node)


@pytest.mark.parametrize("page_size", [1, 2, 8])
def test_random_workload_keeps_free_plus_cached_equal_to_capacity(page_size):
    rng = random.Random(page_size)
    cache = make_cache(page_size, capacity=2048)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 40))] for _ in range(5)]
    for step in range(200):
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 20))]
        if len(tokens) // page_size * page_size + page_size > cache.allocator.available_tokens:
            cache.evict(256)
        cache_request(cache, tokens)
        if step % 17 == 0:
            cache.evict(rng.randrange(1, 64))
        slots = cache.all_slots()
        assert slots.numel() == cache.cached_tokens
        assert slots.unique().numel() == slots.numel()
        assert cache.cached_tokens + cache.allocator.available_tokens == cache.allocator.capacity_tokens
        cache.allocator.check_integrity()
        cache.check_indexes()


def test_evict_at_or_above_drops_unlocked_entries_reaching_the_bound_and_keeps_locked_ones():
    cache = make_cache(4, capacity=64)
    low = cache_request(cache, list(range(8)))  # pages 1-2
    locked = cache_request(cache, list(range(100, 108)))  # pages 3-4
    high = cache_request(cache, list(range(200, 208)))  # pages 5-6
    cache.lock(cache.match_prefix(list(range(100, 108))).node)
    freed = cache.evict_at_or_above(12)  # slot 12 = page 3
    assert freed == 8  # only the unlocked high entry
    assert cache.match_prefix(list(range(200, 208))).num_tokens == 0
    assert torch.equal(cache.match_prefix(list(range(100, 108))).slots, locked)
    assert torch.equal(cache.match_prefix(list(range(8))).slots, low)
    assert cache.cached_tokens == 16 and int(high.min()) >= 20


def test_remap_slots_follows_moved_pages():
    from snugkv.memory.moves import PageMoves

    cache = make_cache(4, capacity=64)
    slots = cache_request(cache, list(range(8)))
    assert slots.tolist() == list(range(4, 12))
    cache.remap_slots(PageMoves(torch.tensor([2]), torch.tensor([7])))
    assert cache.match_prefix(list(range(8))).slots.tolist() == [4, 5, 6, 7, 28, 29, 30, 31]
