"""Slot allocators: contract tests plus random operation sequences checked against a model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from snugkv.memory.allocator import (
    DEBUG_ENV_VAR,
    AllocatorIntegrityError,
    PagedAllocator,
    SlotAllocator,
    TokenAllocator,
    make_allocator,
)


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def pages_of(slots: torch.Tensor, page_size: int) -> list[int]:
    return sorted({int(s) // page_size for s in slots})


# -- capacity and ordering --------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_capacity_excludes_the_dummy_page(page_size: int) -> None:
    alloc = make_allocator(8 * page_size, page_size, debug=True)
    assert alloc.capacity_tokens == alloc.available_tokens == 8 * page_size
    slots = alloc.alloc(8 * page_size)
    assert slots is not None
    assert sorted(slots.tolist()) == list(range(page_size, 9 * page_size))
    assert alloc.available_tokens == 0


def test_alloc_hands_out_lowest_slots_first_even_after_frees() -> None:
    alloc = PagedAllocator(32, 4, debug=True)
    first = alloc.alloc(16)
    assert first is not None and first.tolist() == list(range(4, 20))
    alloc.free(t([16, 8]))  # pages 4 and 2
    again = alloc.alloc(8)
    assert again is not None and again.tolist() == [8, 9, 10, 11, 16, 17, 18, 19]


def test_alloc_returns_none_when_full_and_changes_nothing() -> None:
    alloc = TokenAllocator(4, debug=True)
    assert alloc.alloc(3) is not None
    assert alloc.alloc(2) is None
    assert alloc.available_tokens == 1


def test_alloc_of_zero_tokens_is_an_empty_tensor() -> None:
    slots = PagedAllocator(8, 4).alloc(0)
    assert slots is not None and slots.numel() == 0 and slots.dtype == torch.int64


def test_paged_alloc_refuses_a_partial_page() -> None:
    with pytest.raises(ValueError, match="multiple of page_size=4"):
        PagedAllocator(16, 4).alloc(6)


def test_make_allocator_picks_by_page_size_and_paged_refuses_page_size_one() -> None:
    assert isinstance(make_allocator(8, 1), TokenAllocator)
    assert isinstance(make_allocator(8, 2), PagedAllocator)
    assert isinstance(make_allocator(8, 2), SlotAllocator)
    with pytest.raises(ValueError, match="use TokenAllocator"):
        PagedAllocator(8, 1)


# -- free -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
def test_double_free_names_the_slot(page_size: int) -> None:
    alloc = make_allocator(4 * page_size, page_size)
    slots = alloc.alloc(2 * page_size)
    assert slots is not None
    alloc.free(slots)
    with pytest.raises(ValueError, match=rf"double free: slot {int(slots[-1])}\b"):
        alloc.free(slots[-1:])


def test_failed_free_changes_nothing() -> None:
    alloc = TokenAllocator(8, debug=True)
    slots = alloc.alloc(2)
    assert slots is not None
    with pytest.raises(ValueError, match="slot 7"):
        alloc.free(t([int(slots[0]), 7]))
    assert alloc.available_tokens == 6
    alloc.free(slots)


def test_free_refuses_the_dummy_page_and_slots_outside_the_pool() -> None:
    alloc = PagedAllocator(8, 4)
    with pytest.raises(ValueError, match="slot 2 is in the dummy page"):
        alloc.free([2])
    with pytest.raises(ValueError, match="slot 12 is outside the pool"):
        alloc.free([12])


def test_free_takes_any_slots_of_a_page_and_frees_each_page_once() -> None:
    alloc = PagedAllocator(16, 4, debug=True)
    slots = alloc.alloc(12)
    assert slots is not None and slots.tolist() == list(range(4, 16))
    alloc.free(t([5, 6, 5, 15]))  # page 1 named three times, page 3 once
    assert alloc.available_tokens == 4 + 8
    assert alloc.allocated_pages().tolist() == [2]


def test_free_accepts_int32_tensors_from_the_request_table() -> None:
    alloc = TokenAllocator(4, debug=True)
    slots = alloc.alloc(4)
    assert slots is not None
    alloc.free(slots.to(torch.int32))
    assert alloc.available_tokens == 4


# -- extend and decode ------------------------------------------------------------------------------


def test_extend_fills_the_last_partial_page_before_taking_a_new_one() -> None:
    alloc = PagedAllocator(64, 4, debug=True)
    first = alloc.alloc_extend(t([0]), t([6]), t([-1]))  # positions 0..5: page 1 full, page 2 half
    assert first is not None and first.tolist() == [4, 5, 6, 7, 8, 9]
    more = alloc.alloc_extend(t([6]), t([11]), t([9]))  # fill 10, 11; then a new page for 8..10
    assert more is not None and more.tolist() == [10, 11, 12, 13, 14]


def test_extend_with_a_page_aligned_prefix_starts_a_new_page() -> None:
    alloc = PagedAllocator(64, 4, debug=True)
    first = alloc.alloc_extend(t([0]), t([4]), t([-1]))
    assert first is not None
    more = alloc.alloc_extend(t([4]), t([5]), t([-1]))  # last_loc is not read for aligned prefixes
    assert more is not None and more.tolist() == [8]


def test_extend_concatenates_requests_in_order_with_positions_at_their_page_offsets() -> None:
    alloc = PagedAllocator(64, 4, debug=True)
    base = alloc.alloc_extend(t([0, 0]), t([3, 5]), t([-1, -1]))
    assert base is not None and base.tolist() == [4, 5, 6, 8, 9, 10, 11, 12]
    new = alloc.alloc_extend(t([3, 5, 0]), t([4, 10, 2]), t([6, 12, -1]))
    assert new is not None
    assert new.tolist() == [7, 13, 14, 15, 16, 17, 20, 21]  # request 0 | request 1 | request 2


def test_extend_rejects_a_last_loc_at_the_wrong_page_offset() -> None:
    alloc = PagedAllocator(64, 4)
    assert alloc.alloc_extend(t([0]), t([3]), t([-1])) is not None
    with pytest.raises(ValueError, match=r"request 0: last_loc=5 .* page offset 2"):
        alloc.alloc_extend(t([3]), t([4]), t([5]))


def test_extend_rejects_a_last_loc_in_a_free_page() -> None:
    alloc = PagedAllocator(64, 4)
    with pytest.raises(ValueError, match="last_loc=10 is not an allocated slot"):
        alloc.alloc_extend(t([3]), t([4]), t([10]))


def test_extend_rejects_prefix_longer_than_seq() -> None:
    with pytest.raises(ValueError, match="request 1: need 0 <= prefix_len <= seq_len"):
        TokenAllocator(8).alloc_extend(t([0, 3]), t([1, 2]), t([-1, -1]))


def test_extend_returns_none_when_pages_run_out_and_changes_nothing() -> None:
    alloc = PagedAllocator(8, 4, debug=True)
    assert alloc.alloc_extend(t([0]), t([9]), t([-1])) is None
    assert alloc.available_tokens == 8


def test_token_allocator_extend_and_decode_take_one_slot_per_token() -> None:
    alloc = TokenAllocator(16, debug=True)
    slots = alloc.alloc_extend(t([0, 2]), t([3, 4]), t([-1, 7]))
    assert slots is not None and slots.tolist() == [1, 2, 3, 4, 5]
    decoded = alloc.alloc_decode(t([4, 5]), t([3, 5]))
    assert decoded is not None and decoded.tolist() == [6, 7]


def test_decode_takes_a_new_page_only_when_the_previous_one_is_full() -> None:
    alloc = PagedAllocator(64, 4, debug=True)
    slots = alloc.alloc_extend(t([0, 0]), t([3, 4]), t([-1, -1]))
    assert slots is not None and slots.tolist() == [4, 5, 6, 8, 9, 10, 11]
    decoded = alloc.alloc_decode(t([4, 5]), t([6, 11]))  # request 0 fills slot 7; request 1 needs page 3
    assert decoded is not None and decoded.tolist() == [7, 12]
    decoded = alloc.alloc_decode(t([5, 6]), t([7, 12]))
    assert decoded is not None and decoded.tolist() == [16, 13]


def test_decode_refuses_seq_lens_without_the_new_token() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        PagedAllocator(16, 4).alloc_decode(t([0]), t([-1]))


# -- resize -----------------------------------------------------------------------------------------


def test_resize_grow_adds_free_pages_above_the_old_capacity() -> None:
    alloc = PagedAllocator(8, 4, debug=True)
    assert alloc.alloc(8) is not None
    alloc.resize(16)
    assert alloc.capacity_tokens == 16 and alloc.available_tokens == 8
    grown = alloc.alloc(8)
    assert grown is not None and grown.tolist() == list(range(12, 20))


def test_resize_shrink_refuses_while_slots_above_are_allocated() -> None:
    alloc = TokenAllocator(8, debug=True)
    slots = alloc.alloc(6)
    assert slots is not None
    with pytest.raises(ValueError, match=r"cannot shrink the pool to 4 tokens: 2 page\(s\).*slot 5"):
        alloc.resize(4)
    assert alloc.capacity_tokens == 8
    alloc.free(slots[4:])
    alloc.resize(4)
    assert alloc.capacity_tokens == 4 and alloc.available_tokens == 0


def test_resize_shrink_drops_free_pages_above_and_keeps_the_rest() -> None:
    alloc = PagedAllocator(32, 4, debug=True)
    slots = alloc.alloc(8)
    assert slots is not None
    alloc.resize(12)
    assert alloc.available_tokens == 4
    assert alloc.alloc(8) is None


def test_resize_refuses_a_capacity_that_is_not_whole_pages() -> None:
    with pytest.raises(ValueError, match="multiple of page_size=16"):
        PagedAllocator(32, 16).resize(40)


def test_allocator_can_start_empty_and_grow_after_sizing() -> None:
    alloc = PagedAllocator(0, 16, debug=True)
    assert alloc.alloc(16) is None
    alloc.resize(64)
    assert alloc.available_tokens == 64


# -- integrity and debug ----------------------------------------------------------------------------


def test_check_integrity_catches_a_page_free_twice() -> None:
    alloc = PagedAllocator(16, 4)
    alloc._released.append(t([2]))  # also still in the sorted free list
    with pytest.raises(AllocatorIntegrityError, match="page 2 is free twice"):
        alloc.check_integrity()


def test_check_integrity_catches_an_unsorted_free_list() -> None:
    alloc = PagedAllocator(16, 4)
    alloc._free_pages = t([1, 3, 2, 4])
    with pytest.raises(AllocatorIntegrityError, match="not strictly sorted at page 2"):
        alloc.check_integrity()


def test_pages_freed_in_one_step_are_merged_once_and_still_handed_out_lowest_first() -> None:
    alloc = TokenAllocator(8, debug=True)
    slots = alloc.alloc(8)
    assert slots is not None
    for slot in (7, 2, 5):
        alloc.free([slot])
    assert alloc.available_tokens == 3
    again = alloc.alloc(2)
    assert again is not None and again.tolist() == [2, 5]


def test_check_integrity_catches_a_page_both_free_and_used() -> None:
    alloc = PagedAllocator(16, 4)
    alloc._page_in_use[2] = True
    with pytest.raises(AllocatorIntegrityError, match="page 2 is both free and handed out"):
        alloc.check_integrity()


def test_check_integrity_catches_a_free_dummy_page_and_lost_pages() -> None:
    alloc = TokenAllocator(4)
    alloc._free_pages = t([0, 1, 2, 3, 4])
    with pytest.raises(AllocatorIntegrityError, match="page 0"):
        alloc.check_integrity()
    alloc._free_pages = t([1, 2])
    with pytest.raises(AllocatorIntegrityError, match="2 free \\+ 0 used pages != 4"):
        alloc.check_integrity()


def test_debug_mode_checks_integrity_after_every_operation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEBUG_ENV_VAR, "1")
    alloc = TokenAllocator(8)
    assert alloc.debug
    alloc._page_in_use[3] = True
    with pytest.raises(AllocatorIntegrityError):
        alloc.alloc(1)
    monkeypatch.setenv(DEBUG_ENV_VAR, "0")
    assert not TokenAllocator(8).debug


@pytest.mark.cuda
def test_slots_come_back_on_the_requested_device_and_inputs_may_live_there() -> None:
    alloc = PagedAllocator(64, 4, device="cuda", debug=True)
    slots = alloc.alloc_extend(t([0]).cuda(), t([6]).cuda(), t([-1]).cuda())
    assert slots is not None and slots.device.type == "cuda"
    decoded = alloc.alloc_decode(t([7]).cuda(), slots[-1:])
    assert decoded is not None and decoded.device.type == "cuda"
    alloc.free(torch.cat([slots, decoded]))
    assert alloc.available_tokens == 64


# -- random operation sequences against a model -----------------------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/extend/decode/free/resize sequences; the model is each request's slot list."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[list[int]] = []

    @initialize(page_size=st.sampled_from([1, 2, 16, 64]), num_pages=st.integers(0, 24))
    def start(self, page_size: int, num_pages: int) -> None:
        self.page_size = page_size
        self.alloc = make_allocator(num_pages * page_size, page_size, debug=True)

    def pages_needed(self, prefix: int, seq: int) -> int:
        size = self.page_size
        return -(-seq // size) - -(-prefix // size)

    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        size = self.page_size
        chosen = data.draw(st.lists(st.integers(0, len(self.requests)), max_size=4, unique=True))
        ext = [data.draw(st.integers(1, 2 * size + 3)) for _ in chosen]
        rows = [self.requests[i] if i < len(self.requests) else [] for i in chosen]
        prefix = [len(r) for r in rows]
        last = [r[-1] if r else -1 for r in rows]
        seq = [p + e for p, e in zip(prefix, ext)]
        needed = sum(self.pages_needed(p, s) for p, s in zip(prefix, seq))
        before = self.alloc.available_tokens
        slots = self.alloc.alloc_extend(t(prefix), t(seq), t(last))
        if slots is None:
            assert needed * size > before and self.alloc.available_tokens == before
            return
        assert slots.numel() == sum(ext) and self.alloc.available_tokens == before - needed * size
        new_rows: list[list[int]] = []
        for row, p, e, loc in zip(rows, prefix, ext, last):
            got, slots = slots[:e].tolist(), slots[e:]
            fill = min((size - p % size) % size, e)
            assert got[:fill] == list(range(loc + 1, loc + 1 + fill)), "partial page not filled first"
            if fill < e:  # then fresh pages, starting at offset 0
                assert got[fill] % size == 0
            new_rows.append(row + got)
        for i, row in zip(chosen, new_rows):
            if i < len(self.requests):
                self.requests[i] = row
            else:
                self.requests.append(row)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.integers(0, len(self.requests) - 1), min_size=1, unique=True))
        seq = [len(self.requests[i]) + 1 for i in chosen]
        needed = sum((s - 1) % self.page_size == 0 for s in seq)
        before = self.alloc.available_tokens
        slots = self.alloc.alloc_decode(t(seq), t([self.requests[i][-1] for i in chosen]))
        if slots is None:
            assert needed * self.page_size > before and self.alloc.available_tokens == before
            return
        for i, slot in zip(chosen, slots.tolist()):
            self.requests[i].append(slot)

    @rule(num_pages=st.integers(0, 6))
    def alloc_pages(self, num_pages: int) -> None:
        slots = self.alloc.alloc(num_pages * self.page_size)
        if slots is None:
            assert num_pages * self.page_size > self.alloc.available_tokens
        elif num_pages:
            self.requests.append(slots.tolist())

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        row = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        one_per_page = data.draw(st.booleans())
        self.alloc.free(t(row[:: self.page_size] if one_per_page else row[::-1]))
        with pytest.raises(ValueError, match="double free"):
            self.alloc.free(t(row[-1:]))

    @rule(delta_pages=st.integers(-8, 8))
    def resize(self, delta_pages: int) -> None:
        size = self.page_size
        highest = max((s // size for row in self.requests for s in row), default=0)
        target = max(0, self.alloc.capacity_tokens + delta_pages * size)
        if target // size < highest:
            with pytest.raises(ValueError, match="cannot shrink"):
                self.alloc.resize(target)
            target = highest * size
        self.alloc.resize(target)
        assert self.alloc.capacity_tokens == target

    @invariant()
    def model_matches(self) -> None:
        if not hasattr(self, "alloc"):
            return
        self.alloc.check_integrity()
        size = self.page_size
        owner: dict[int, int] = {}
        for i, row in enumerate(self.requests):
            for position, slot in enumerate(row):
                assert slot % size == position % size, "position not at its page offset"
                assert owner.setdefault(slot // size, i) == i, f"page {slot // size} shared by requests"
        assert len(set(owner)) == sum(-(-len(row) // size) for row in self.requests)
        assert self.alloc.available_tokens == self.alloc.capacity_tokens - len(owner) * size


TestAllocatorSequences = AllocatorMachine.TestCase
TestAllocatorSequences.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)


def _extend_scenario(page_size: int, seed: int) -> list[list[int]]:
    """Random extensions (some continuing a partial page, some of several requests at once) and
    frees on one allocator; the slots each extension got."""
    import random

    rng = random.Random(seed)
    alloc = PagedAllocator(page_size * 64, page_size)
    requests: list[list[int]] = [[] for _ in range(4)]
    got: list[list[int]] = []
    for _ in range(40):
        chosen = rng.sample(range(4), rng.randint(1, 3))
        prefix = [len(requests[r]) for r in chosen]
        seq = [p + rng.randint(0, 2 * page_size + 1) for p in prefix]
        last = [requests[r][-1] if requests[r] else -1 for r in chosen]
        slots = alloc.alloc_extend(t(prefix), t(seq), t(last))
        if slots is None:
            got.append([])
        else:
            got.append(slots.tolist())
            start = 0
            for r, p, s in zip(chosen, prefix, seq):
                requests[r] += slots[start : start + s - p].tolist()
                start += s - p
        if rng.random() < 0.2:
            r = rng.randrange(4)
            alloc.free(requests[r]) if requests[r] else None
            requests[r] = []
        alloc.check_integrity()
    got.append(sorted(alloc.allocated_pages().tolist()))
    return got


@pytest.mark.parametrize("page_size", [2, 4, 16])
def test_a_few_tokens_in_python_take_the_slots_and_pages_the_tensor_path_takes(
    page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Extensions of up to SMALL_EXTEND_TOKENS tokens run in plain Python (a verify step's rows);
    with that path off every one runs through the tensor ops: the same slots, the same pages."""
    from snugkv.memory import allocator as allocator_module

    few = [_extend_scenario(page_size, seed) for seed in range(5)]
    monkeypatch.setattr(allocator_module, "SMALL_EXTEND_TOKENS", -1)
    assert few == [_extend_scenario(page_size, seed) for seed in range(5)]


def test_a_few_tokens_are_checked_as_the_tensor_path_checks_them() -> None:
    alloc = PagedAllocator(64, 4)
    with pytest.raises(ValueError, match="need 0 <= prefix_len <= seq_len"):
        alloc.alloc_extend(t([3]), t([2]), t([-1]))
    with pytest.raises(ValueError, match="last_loc has 2 entries"):
        alloc.alloc_extend(t([0]), t([2]), t([-1, -1]))
    with pytest.raises(ValueError, match="is not an allocated slot"):
        alloc.alloc_extend(t([2]), t([3]), t([9]))  # continues a partial page it does not hold
    with pytest.raises(TypeError, match="must hold integers"):
        alloc.alloc_extend(torch.tensor([0.0]), t([2]), t([-1]))
