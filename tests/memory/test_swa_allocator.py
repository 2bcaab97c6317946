"""Sliding-window allocation: paired full/window slots, the full_to_swa mapping, window eviction."""

from __future__ import annotations

import random

import pytest
import torch

from snugkv.memory.allocator import AllocatorIntegrityError
from snugkv.memory.swa_allocator import SWAAllocator


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def make(full_tokens: int, swa_tokens: int, page_size: int, spare_tokens: int = 0) -> SWAAllocator:
    mapping = torch.full((full_tokens + page_size + spare_tokens,), -7, dtype=torch.int64)
    return SWAAllocator(full_tokens, swa_tokens, page_size, mapping, debug=True)


def test_dummy_page_maps_to_itself_and_every_other_entry_to_zero() -> None:
    swa = make(16, 8, 4)
    assert swa.full_to_swa.tolist() == [0, 1, 2, 3] + [0] * 16


def test_alloc_maps_every_full_slot_to_a_window_slot_at_the_same_page_offset() -> None:
    swa = make(16, 8, 4)
    full = swa.alloc(8)
    assert full is not None and full.tolist() == list(range(4, 12))
    assert swa.full_to_swa[full].tolist() == list(range(4, 12))
    assert swa.available_tokens == 0  # the window pool is the smaller one
    assert swa.full_available_tokens == 8


def test_alloc_returns_none_when_the_window_pool_is_full_and_changes_nothing() -> None:
    swa = make(16, 4, 4)
    assert swa.alloc(4) is not None
    assert swa.alloc(4) is None
    assert swa.full_available_tokens == 12 and swa.swa_available_tokens == 0


def test_free_swa_frees_the_window_slots_and_zeros_their_mapping() -> None:
    swa = make(16, 8, 4)
    full = swa.alloc_extend(t([0]), t([6]), t([-1]))
    assert full is not None
    swa.free_swa(full[:4])  # page 1 left the window
    assert swa.full_to_swa[full].tolist() == [0, 0, 0, 0, 8, 9]
    assert swa.swa_available_tokens == 4 and swa.full_available_tokens == 8


def test_freed_window_pages_are_reused_for_new_tokens() -> None:
    swa = make(32, 8, 4)
    full = swa.alloc_extend(t([0]), t([8]), t([-1]))
    assert full is not None
    swa.free_swa(full[:4])
    more = swa.alloc_extend(t([8]), t([12]), t([int(full[-1])]))
    assert more is not None and swa.full_to_swa[more].tolist() == [4, 5, 6, 7]


def test_free_after_free_swa_frees_only_the_full_slots_left() -> None:
    swa = make(16, 8, 4)
    full = swa.alloc(8)
    assert full is not None
    swa.free_swa(full[:4])
    swa.free(full)
    assert swa.full_available_tokens == 16 and swa.swa_available_tokens == 8
    assert swa.full_to_swa[4:].count_nonzero() == 0


def test_free_swa_twice_names_the_slot() -> None:
    swa = make(16, 8, 4)
    full = swa.alloc(4)
    assert full is not None
    swa.free_swa(full)
    with pytest.raises(ValueError, match="full slot 5 has no window slot"):
        swa.free_swa(t([5]))


def test_double_free_names_the_slot_and_changes_nothing() -> None:
    swa = make(8, 8, 1)
    full = swa.alloc(2)
    assert full is not None
    swa.free(full[:1])
    with pytest.raises(ValueError, match="double free: slot 1"):
        swa.free(full)
    assert swa.full_to_swa[2].item() == 2


def test_extend_continues_the_partial_page_in_the_same_window_page() -> None:
    swa = make(32, 16, 4)
    other = swa.alloc(4)  # makes full and window page numbers differ below
    assert other is not None
    swa.free_swa(other)
    first = swa.alloc_extend(t([0]), t([3]), t([-1]))
    assert first is not None and first.tolist() == [8, 9, 10]
    more = swa.alloc_extend(t([3]), t([5]), t([10]))
    assert more is not None and more.tolist() == [11, 12]
    assert swa.full_to_swa[torch.cat([first, more])].tolist() == [4, 5, 6, 7, 8]


def test_continuing_a_partial_page_whose_window_page_was_freed_gets_a_new_one() -> None:
    swa = make(32, 16, 4)
    full = swa.alloc_extend(t([0]), t([2]), t([-1]))
    assert full is not None
    swa.free_swa(full)  # the caller broke the whole-page rule; the allocator still stays sound
    decoded = swa.alloc_decode(t([3]), t([int(full[-1])]))
    assert decoded is not None and decoded.tolist() == [6]
    assert swa.full_to_swa[t([4, 5, 6])].tolist() == [0, 0, 6]


def test_decode_pairs_each_new_page() -> None:
    swa = make(32, 16, 2)
    full = swa.alloc_extend(t([0, 0]), t([1, 2]), t([-1, -1]))
    assert full is not None and full.tolist() == [2, 4, 5]
    decoded = swa.alloc_decode(t([2, 3]), t([2, 5]))
    assert decoded is not None and decoded.tolist() == [3, 6]
    assert swa.full_to_swa[2:8].tolist() == [2, 3, 4, 5, 6, 0]


def test_resize_grows_both_pools_and_clears_the_new_mapping_entries() -> None:
    swa = make(8, 4, 4, spare_tokens=8)
    swa.full_to_swa[12:] = 99  # memory just committed may hold anything
    swa.resize_groups(16, 8)
    assert swa.full_capacity_tokens == 16 and swa.swa_capacity_tokens == 8
    assert swa.full_to_swa[12:20].count_nonzero() == 0


def test_resize_to_a_larger_mapping_copies_the_live_entries() -> None:
    swa = make(8, 8, 4)
    full = swa.alloc(4)
    assert full is not None
    bigger = torch.full((36,), -1, dtype=torch.int64)
    swa.resize_groups(32, 8, full_to_swa=bigger)
    assert swa.full_to_swa is bigger
    assert bigger[:8].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert bigger[8:].count_nonzero() == 0


def test_resize_that_fails_on_the_window_pool_leaves_the_full_pool_as_it_was() -> None:
    swa = make(16, 16, 4, spare_tokens=16)
    full = swa.alloc(16)
    assert full is not None
    swa.free(full[:12])  # full pages 1..3 free, window pages 1..3 free; page 4 of both in use
    with pytest.raises(ValueError, match="cannot shrink"):
        swa.resize_groups(32, 8)
    assert swa.full_capacity_tokens == 16 and swa.swa_capacity_tokens == 16


def test_mapping_shorter_than_the_full_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="at least full_tokens \\+ page_size = 20"):
        SWAAllocator(16, 8, 4, torch.zeros(16, dtype=torch.int64))


def test_check_integrity_catches_a_mapping_that_disagrees_with_the_pairing() -> None:
    swa = make(16, 8, 4)
    full = swa.alloc(4)
    assert full is not None
    swa.full_to_swa[5] = 7
    with pytest.raises(AllocatorIntegrityError, match=r"full_to_swa\[5\] = 7"):
        swa.check_integrity()


@pytest.mark.cuda
def test_mapping_on_the_gpu_is_kept_and_slots_come_back_there() -> None:
    mapping = torch.zeros(36, dtype=torch.int64, device="cuda")
    swa = SWAAllocator(32, 16, 4, mapping, debug=True)
    full = swa.alloc_extend(t([0]).cuda(), t([6]).cuda(), t([-1]).cuda())
    assert full is not None and full.device.type == "cuda"
    decoded = swa.alloc_decode(t([7]).cuda(), full[-1:])
    assert decoded is not None
    swa.free_swa(full[:4])
    assert mapping[torch.cat([full, decoded])].tolist() == [0, 0, 0, 0, 8, 9, 10]
    swa.free(torch.cat([full, decoded]))
    assert swa.full_available_tokens == 32 and swa.swa_available_tokens == 16


# -- random sequences with a sliding window ---------------------------------------------------------


class WindowModel:
    """Requests as full-slot lists; pages wholly out of the window have their window slots freed."""

    def __init__(self, swa: SWAAllocator, window: int, rng: random.Random) -> None:
        self.swa, self.window, self.rng = swa, window, rng
        self.requests: list[list[int]] = []
        self.evicted_pages: list[int] = []

    def slide_windows(self) -> None:
        size = self.swa.page_size
        for i, row in enumerate(self.requests):
            out_pages = max(
                0, (len(row) - self.window + 1) // size
            )  # pages with every position <= len - window
            if out_pages > self.evicted_pages[i]:
                slots = row[self.evicted_pages[i] * size : out_pages * size]
                self.swa.free_swa(t(slots if self.rng.random() < 0.5 else slots[::size]))
                self.evicted_pages[i] = out_pages

    def check(self) -> None:
        self.swa.check_integrity()
        size, mapping = self.swa.page_size, self.swa.full_to_swa.tolist()
        window_slots: list[int] = []
        for row, evicted in zip(self.requests, self.evicted_pages):
            for position, slot in enumerate(row):
                assert slot % size == position % size
                if position < evicted * size:
                    assert mapping[slot] == 0, "evicted token still has a window slot"
                else:
                    assert mapping[slot] >= size and mapping[slot] % size == slot % size
                    window_slots.append(mapping[slot])
        assert len(window_slots) == len(set(window_slots)), "a window slot is shared"


@pytest.mark.parametrize("page_size", [1, 2, 16, 64])
@pytest.mark.parametrize("seed", range(4))
def test_random_sequences_keep_both_pools_and_the_mapping_consistent(page_size: int, seed: int) -> None:
    rng = random.Random(seed * 100 + page_size)
    full_pages = rng.randint(8, 24)
    swa = make(
        full_pages * page_size, rng.randint(2, full_pages) * page_size, page_size, spare_tokens=8 * page_size
    )
    model = WindowModel(swa, window=rng.randint(1, 3 * page_size), rng=rng)
    for _ in range(60):
        op = rng.choice(["extend", "extend", "decode", "decode", "free", "resize"])
        if op == "extend":
            chosen = rng.sample(range(len(model.requests) + 1), k=min(2, len(model.requests) + 1))
            rows = [model.requests[i] if i < len(model.requests) else [] for i in chosen]
            prefix = [len(r) for r in rows]
            seq = [p + rng.randint(1, 2 * page_size + 1) for p in prefix]
            before = (swa.full_available_tokens, swa.swa_available_tokens)
            slots = swa.alloc_extend(t(prefix), t(seq), t([r[-1] if r else -1 for r in rows]))
            if slots is None:
                assert (swa.full_available_tokens, swa.swa_available_tokens) == before
                continue
            got = slots.tolist()
            for i, p, s in zip(chosen, prefix, seq):
                new, got = got[: s - p], got[s - p :]
                if i < len(model.requests):
                    model.requests[i] += new
                else:
                    model.requests.append(new)
                    model.evicted_pages.append(0)
        elif op == "decode" and model.requests:
            chosen = rng.sample(range(len(model.requests)), k=rng.randint(1, len(model.requests)))
            seq = [len(model.requests[i]) + 1 for i in chosen]
            slots = swa.alloc_decode(t(seq), t([model.requests[i][-1] for i in chosen]))
            for i, slot in zip(chosen, [] if slots is None else slots.tolist()):
                model.requests[i].append(slot)
        elif op == "free" and model.requests:
            i = rng.randrange(len(model.requests))
            swa.free(t(model.requests.pop(i)))
            model.evicted_pages.pop(i)
        elif op == "resize":
            highest_full = max((s // page_size for r in model.requests for s in r), default=0)
            full_tokens = max(highest_full, full_pages + rng.randint(-4, 4)) * page_size
            try:
                swa.resize_groups(full_tokens, swa.swa_capacity_tokens + rng.randint(-2, 2) * page_size)
            except ValueError as error:
                assert "cannot shrink" in str(error) or "non-negative" in str(error)
        model.slide_windows()
        model.check()
