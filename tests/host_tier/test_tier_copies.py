"""The host tier's two copy paths on CPU (host memory as the 'device'): pages written to the host
and loaded back into other device pages arrive bit for bit in every pool layout and page size,
from fragmented device and host page lists, through a staging smaller than a request's pages; the
batched path issues far fewer copies than one per run per buffer, and reuses its staging in order
when copies are held back."""

from __future__ import annotations

import pytest
import torch

from snugkv.memory.host_tier import HostCopies, HostKvTier
from snugkv.memory.tier_copies import (
    INDEX_ALIGN_BYTES,
    PerRunCopies,
    StagedCopies,
    chunk_pages_of,
    host_runs,
    page_runs,
)
from tests.host_tier.held_copies import HeldCopies, staging_for
from tests.memory.test_kv_pools import make_pool

POOL_PAGES = 40
HOST_PAGES = 32


def fill_random(views: list[torch.Tensor], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for view in views:
        view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=generator))


def tier_of(views: list[torch.Tensor], page_size: int, chunk_pages: int | None, copies=None) -> HostKvTier:
    page_bytes = sum(view.shape[1] for view in views)
    return HostKvTier(
        views,
        num_pages=HOST_PAGES,
        page_size=page_size,
        copies=copies or HostCopies(),
        pin_memory=False,
        staging=None if chunk_pages is None else staging_for(chunk_pages, page_bytes),
    )


def fragmented_host_pages(tier: HostKvTier, count: int) -> torch.Tensor:
    """`count` host pages that are not one run: every other page of the tier's first ones."""
    taken = tier.alloc(2 * count)
    assert taken is not None
    tier.free(taken[1::2])
    return taken[::2].flip(0)


@pytest.mark.parametrize("chunk_pages", [None, 1, 3, 64], ids=["per-run", "chunk1", "chunk3", "chunk64"])
@pytest.mark.parametrize(
    ("kind", "layout", "page_size", "dtype"),
    [
        ("mha", "nhd", 1, "bfloat16"),
        ("mha", "nhd", 4, "float32"),
        ("mha", "hnd", 16, "bfloat16"),
        ("mla", "nhd", 1, "bfloat16"),
        ("mla", "nhd", 16, "float8_e4m3fn"),
    ],
)
def test_pages_round_trip_bit_for_bit_from_fragmented_lists_in_every_layout(
    kind, layout, page_size, dtype, chunk_pages
):
    pool = make_pool(
        kind,
        dtype=dtype,
        page_size=page_size,
        layout=layout,
        reserved_tokens=POOL_PAGES * page_size,
        mode="static",
    )
    views = pool.page_views()
    fill_random(views, seed=page_size)
    tier = tier_of(views, page_size, chunk_pages)
    source = torch.tensor([3, 4, 5, 9, 12, 13, 2, 30])  # runs, a step back, a jump
    host = fragmented_host_pages(tier, source.numel())
    expected = [view[source].clone() for view in views]
    tier.write(source, host).wait()
    for view in views:
        view.zero_()
    target = torch.tensor([20, 21, 1, 25, 26, 27, 7, 6])
    tier.load(host, target).wait()
    assert all(torch.equal(view[target], want) for view, want in zip(views, expected))
    untouched = torch.ones(views[0].shape[0], dtype=torch.bool)
    untouched[target] = False
    assert all(int(view[untouched].count_nonzero()) == 0 for view in views)  # nothing else written
    assert tier.traffic().bytes_to_device == tier.traffic().bytes_to_host == source.numel() * tier.page_bytes
    tier.close()
    pool.close()


def test_both_paths_move_the_same_bytes_and_the_batched_one_issues_far_fewer_copies():
    pool = make_pool(
        "mha", dtype="bfloat16", page_size=4, layout="nhd", reserved_tokens=POOL_PAGES * 4, mode="static"
    )
    views = pool.page_views()
    fill_random(views, seed=7)
    # scattered device pages (a fragmented prefix) to consecutive host pages, loaded back to consecutive ones
    source = torch.randperm(POOL_PAGES - 1, generator=torch.Generator().manual_seed(0))[:HOST_PAGES] + 1
    target = torch.arange(1, source.numel() + 1)
    loaded = []
    issued = {}
    for chunk_pages in (None, 8):
        tier = tier_of(views, 4, chunk_pages)
        host = tier.alloc(source.numel())
        assert host is not None
        tier.write(source, host).wait()
        saved = [view[target].clone() for view in views]
        tier.load(host, target).wait()
        loaded.append([view[target].clone() for view in views])
        for view, rows in zip(views, saved):
            view[target] = rows
        issued[tier.path.name] = tier.path.issued
        tier.close()
    assert all(torch.equal(a, b) for a, b in zip(*loaded))
    host = torch.arange(1, source.numel() + 1)  # what both tiers allocated, lowest first
    runs = len(page_runs(source, host)) + len(page_runs(target, host))
    assert runs > source.numel() // 2 and issued["per-run"] == runs * len(views)
    # 4 chunks of 8 a direction: an index upload, one host run, one gather/scatter per buffer
    assert issued["batched"] == 2 * 4 * (1 + 1 + len(views)) < issued["per-run"]
    pool.close()


def test_the_staging_is_reused_in_copy_order_when_copies_are_held_back():
    pool = make_pool(
        "mla", dtype="bfloat16", page_size=2, layout="nhd", reserved_tokens=POOL_PAGES * 2, mode="static"
    )
    views = pool.page_views()
    fill_random(views, seed=3)
    held = HeldCopies()
    tier = tier_of(views, 2, chunk_pages=2, copies=held)  # every copy below is two chunks
    first, second = torch.tensor([1, 2, 3]), torch.tensor([10, 14, 11])
    expected = [[view[pages].clone() for view in views] for pages in (first, second)]
    host_first, host_second = tier.alloc(3), tier.alloc(3)
    assert host_first is not None and host_second is not None
    tier.write(first, host_first)
    tier.write(second, host_second)
    targets = torch.tensor([30, 31, 32]), torch.tensor([33, 34, 35])
    tier.load(host_first, targets[0])
    tier.load(host_second, targets[1])
    assert (
        held.pending == 4 and held.ran == 0
    )  # nothing ran yet: each runs its own chunks when its turn comes
    held.flush()
    for pages, want in zip(targets, expected):
        assert all(torch.equal(view[pages], rows) for view, rows in zip(views, want))
    pool.close()


@pytest.mark.parametrize(("rows", "word_bytes"), [([5, 7], 1), ([4, 12], 4), ([16, 8], 8), ([6, 2], 2)])
def test_rows_move_as_the_widest_word_every_row_and_offset_allows(rows, word_bytes):
    generator = torch.Generator().manual_seed(1)
    views = [torch.randint(0, 256, (9, row), dtype=torch.uint8, generator=generator) for row in rows]
    page_bytes = sum(rows)
    host = torch.zeros((HOST_PAGES + 1) * page_bytes, dtype=torch.uint8)
    path = StagedCopies(views, host, HOST_PAGES, staging_for(2, page_bytes))
    assert path.word_bytes == word_bytes and path.chunk_pages == 2
    source, host_pages, target = torch.tensor([8, 1, 4]), torch.tensor([5, 6, 2]), torch.tensor([3, 2, 7])
    expected = [view[source].clone() for view in views]
    path.write(source, host_pages)()
    path.load(host_pages, target)()
    assert all(torch.equal(view[target], want) for view, want in zip(views, expected))


def test_a_staging_that_holds_no_page_is_refused_and_the_per_run_path_needs_none():
    views = [torch.zeros(4, 1000, dtype=torch.uint8)]
    host = torch.zeros(5 * 1000, dtype=torch.uint8)
    assert chunk_pages_of(INDEX_ALIGN_BYTES + 1007, 1000) == 0
    with pytest.raises(ValueError, match="holds no page"):
        StagedCopies(views, host, 4, torch.zeros(INDEX_ALIGN_BYTES + 1007, dtype=torch.uint8))
    assert PerRunCopies(views, host, 4).name == "per-run"


def test_runs_split_where_either_list_breaks():
    assert page_runs(torch.tensor([3, 4, 5, 9]), torch.tensor([1, 2, 7, 8])) == [
        (3, 1, 2),
        (5, 7, 1),
        (9, 8, 1),
    ]
    assert host_runs(torch.tensor([4, 5, 6, 2, 3])) == [(4, 0, 3), (2, 3, 2)]
    assert page_runs(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64)) == []


@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_lanes_take_the_chunks_in_turn_and_every_page_arrives(lanes):
    """The staging split into lanes (on a GPU: one chunk's gathers or scatters beside the next one's
    host copy): each lane carries its share, chunks use them in turn, and every page arrives."""
    generator = torch.Generator().manual_seed(5)
    rows = [24, 40]
    views = [torch.randint(0, 256, (40, row), dtype=torch.uint8, generator=generator) for row in rows]
    page_bytes = sum(rows)
    host = torch.zeros((HOST_PAGES + 1) * page_bytes, dtype=torch.uint8)
    path = StagedCopies(views, host, HOST_PAGES, staging_for(6, page_bytes), lanes=lanes)
    assert (path.lanes, path.chunk_pages) == (lanes, 6 // lanes)
    source = torch.tensor([8, 1, 4, 30, 31, 32, 17, 2, 9, 5, 22])  # 11 pages: several chunks a lane
    host_pages = torch.arange(1, source.numel() + 1)
    target = torch.tensor([33, 34, 35, 36, 37, 38, 39, 20, 21, 23, 24])
    expected = [view[source].clone() for view in views]
    path.write(source, host_pages)()
    path.load(host_pages, target)()
    assert all(torch.equal(view[target], want) for view, want in zip(views, expected))
