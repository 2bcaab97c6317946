"""Shrinking under live allocations: pages above the new capacity move to free pages below it, the
allocators' bookkeeping stays sound after every step, and the KV of every live slot survives the
move bit for bit in every pool kind, layout and dtype."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from snugkv.memory.allocator import PagedAllocator, TokenAllocator
from snugkv.memory.kv_pool import KVPool
from snugkv.memory.moves import KvMoves, PageMoves
from snugkv.memory.req_to_token import ReqToTokenPool
from snugkv.memory.swa_allocator import SWAAllocator
from snugkv.runner.kv_cache import make_slot_allocator
from tests.memory.test_kv_pools import make_pool


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_page_moves_remap_only_the_slots_of_moved_pages_and_keep_their_offsets() -> None:
    moves = PageMoves(t([5, 9]), t([1, 2]))
    slots = torch.tensor([[20, 21, 23, 36, 39, 4, 0]], dtype=torch.int32)
    assert moves.remap_slots(slots, 4).tolist() == [[4, 5, 7, 8, 11, 4, 0]]
    assert moves.remap_slots(slots, 4).dtype == torch.int32
    assert PageMoves().remap_slots(slots, 4) is slots


@pytest.mark.parametrize("allocator_class", [TokenAllocator, PagedAllocator])
def test_plan_shrink_moves_every_page_above_to_the_lowest_free_pages_below(allocator_class) -> None:
    page = 1 if allocator_class is TokenAllocator else 4
    alloc = allocator_class(16 * page, page, debug=True) if page > 1 else allocator_class(16, debug=True)
    taken = alloc.alloc(12 * page)
    assert taken is not None
    alloc.free(taken[: 6 * page])  # pages 1..6 free, 7..12 in use
    plan = alloc.plan_shrink(8 * page)
    assert plan is not None
    assert plan.full.src_pages.tolist() == [9, 10, 11, 12] and plan.full.dst_pages.tolist() == [1, 2, 3, 4]
    alloc.apply_moves(plan)
    alloc.resize(8 * page)
    alloc.check_integrity()
    assert alloc.allocated_pages().tolist() == [1, 2, 3, 4, 7, 8]
    assert alloc.available_tokens == 2 * page


def test_plan_shrink_is_none_when_the_pages_in_use_do_not_fit_below_and_changes_nothing() -> None:
    alloc = PagedAllocator(32, 4, debug=True)
    assert alloc.alloc(24) is not None
    assert alloc.plan_shrink(20) is None
    assert alloc.available_tokens == 8 and alloc.capacity_tokens == 32
    plan = alloc.plan_shrink(24)
    assert plan is not None and plan.num_pages == 0


def test_apply_moves_refuses_a_stale_plan() -> None:
    alloc = PagedAllocator(16, 4, debug=True)
    slots = alloc.alloc(16)
    assert slots is not None
    alloc.free(slots[:4])
    plan = alloc.plan_shrink(12)
    assert plan is not None
    alloc.alloc(4)  # page 1, the plan's destination, is taken meanwhile
    with pytest.raises(ValueError, match="plan them again"):
        alloc.apply_moves(plan)


def test_swa_moves_keep_pairing_and_mapping_consistent() -> None:
    size = 4
    mapping = torch.full((32 + size,), -7, dtype=torch.int64)
    window_share = lambda full: full * 3 // 4 // size * size  # noqa: E731
    swa = SWAAllocator(32, 24, size, mapping, debug=True, swa_tokens_for=window_share)
    first = swa.alloc_extend(t([0]), t([12]), t([-1]))  # full pages 1-3, window pages 1-3
    second = swa.alloc_extend(t([0]), t([6]), t([-1]))  # full pages 4-5, window pages 4-5
    assert first is not None and second is not None
    swa.free_swa(first[:4])  # full page 1 left the window
    swa.free(first)  # the first request ends: full pages 1-3 and window pages 2-3 free
    assert swa.plan_shrink(8) is None  # a window of one page cannot hold two pages in use
    plan = swa.plan_shrink(16)  # full pages 1..4, window pages 1..3
    assert plan is not None
    assert plan.full.src_pages.tolist() == [5] and plan.full.dst_pages.tolist() == [1]
    assert plan.window.src_pages.tolist() == [4, 5] and plan.window.dst_pages.tolist() == [1, 2]
    swa.apply_moves(plan)
    swa.resize(16)
    swa.check_integrity()
    moved = plan.full.remap_slots(second, size)
    assert moved.tolist() == [16, 17, 18, 19, 4, 5]
    assert swa.full_to_swa[moved].tolist() == [4, 5, 6, 7, 8, 9]


def _read_slot(pool: KVPool, layer: int, slot: int) -> bytes:
    key, value = pool.get_kv_buffer(layer)
    slot_map = pool.slot_map(layer)
    row = int(slot_map[slot]) if slot_map is not None else slot
    size = pool.page_size
    parts = []
    for buffer in (key, value):
        cell = buffer[row] if pool.layout.value == "nhd" else buffer[row // size, :, row % size]
        parts.append(cell.contiguous().view(torch.uint8).numpy().tobytes())
    return b"".join(parts)


def _layers(pool: KVPool) -> list[int]:
    return list(range(pool.num_layers))  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["mha", "mla", "swa"])
@pytest.mark.parametrize(("layout", "page_size"), [("nhd", 1), ("nhd", 4), ("hnd", 4)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8_e4m3"])
def test_a_shrink_moves_live_kv_bit_for_bit(kind, layout, page_size, dtype) -> None:
    rng = random.Random(zlib.crc32(f"{kind}{layout}{page_size}{dtype}".encode()))
    pool = make_pool(
        kind, dtype=dtype, page_size=page_size, layout=layout, reserved_tokens=256, mode="post-capture"
    )
    pool.ensure_prefix()
    pool.finalize_backing(256)
    alloc = make_slot_allocator(pool, 256)
    table = ReqToTokenPool(8, 96)
    rows: dict[int, int] = {}
    for _ in range(6):  # requests of various lengths, then free every other one to leave holes
        row = table.alloc()
        assert row is not None
        length = rng.randrange(page_size, 24)  # six fit the window sub-pool (0.6 x 256)
        slots = alloc.alloc_extend(t([0]), t([length]), t([-1]))
        assert slots is not None
        table.write(row, 0, slots)
        rows[row] = length
        heads, dim = (1, 40) if kind == "mla" else ((3, 24) if kind == "mha" else (2, 16))
        for layer in _layers(pool):
            k = torch.randn(length, heads, dim) * 4
            pool.set_kv(layer, slots, k, None if kind == "mla" else k * -2)
    for row in list(rows)[::2]:
        alloc.free(table.req_to_token[row, : rows.pop(row)])
        table.free(row)
    before = {
        (row, pos, layer): _read_slot(pool, layer, int(table.req_to_token[row, pos]))
        for row, length in rows.items()
        for pos in range(length)
        for layer in _layers(pool)
    }
    feasible = [n for n in range(256, 0, -page_size) if alloc.plan_shrink(n) is not None]
    target = feasible[-1]  # as small as the live pages allow: the freed holes sit low
    plan = alloc.plan_shrink(target)
    assert plan is not None and plan.num_pages > 0
    pool.move_pages(plan)
    alloc.apply_moves(plan)
    table.remap_slots(plan.full, page_size)
    alloc.resize(target)
    pool.finalize_backing(target)
    alloc.check_integrity()
    assert int(table.req_to_token[list(rows)].max()) < target + page_size
    after = {
        (row, pos, layer): _read_slot(pool, layer, int(table.req_to_token[row, pos]))
        for row, length in rows.items()
        for pos in range(length)
        for layer in _layers(pool)
    }
    assert after == before
    pool.close()


def test_kv_moves_count_both_sub_pools() -> None:
    moves = KvMoves(PageMoves(t([3]), t([1])), PageMoves(t([5, 6]), t([1, 2])))
    assert moves.num_pages == 3
