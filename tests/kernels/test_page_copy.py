"""One launch for every KV buffer's rows of a staged chunk (memory/page_copy.py), in the Triton
interpreter: gather and scatter match a per-buffer index_select / index_copy_, and only the named
pages change."""

from __future__ import annotations

import pytest
import torch

from snugkv.memory.page_copy import buffer_table, gather_pages, scatter_pages, uniform_rows


def buffers(count: int, pages: int, row_words: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [
        torch.arange(pages * row_words, dtype=torch.int64).reshape(pages, row_words).to(dtype) + 10_000 * b
        for b in range(count)
    ]


@pytest.mark.parametrize(("row_words", "dtype"), [(8, torch.int64), (1500, torch.int32), (3, torch.int16)])
def test_gather_then_scatter_move_every_buffers_rows_of_the_named_pages(row_words, dtype) -> None:
    pool = buffers(3, 9, row_words, dtype)
    table = buffer_table(pool)
    index = torch.tensor([7, 2, 5], dtype=torch.int64)
    staged = torch.zeros(4, 3 * row_words, dtype=dtype)  # a chunk with room for a page more
    gather_pages(staged, index, table, row_words)
    expected = torch.cat([torch.index_select(buffer, 0, index) for buffer in pool], dim=1)
    assert torch.equal(staged[:3], expected) and not staged[3].any()

    before = [buffer.clone() for buffer in pool]
    targets = torch.tensor([0, 8, 4], dtype=torch.int64)
    scatter_pages(staged, targets, table, row_words)
    for b, (buffer, old) in enumerate(zip(pool, before)):
        want = old.clone()
        want.index_copy_(0, targets, expected[:, b * row_words : (b + 1) * row_words])
        assert torch.equal(buffer, want)


def test_a_chunk_that_does_not_match_the_buffers_is_refused_and_uneven_rows_are_not_uniform() -> None:
    pool = buffers(2, 4, 8, torch.int64)
    with pytest.raises(ValueError, match="does not hold"):
        gather_pages(torch.zeros(1, 16, dtype=torch.int64), torch.tensor([0, 1]), buffer_table(pool), 8)
    assert uniform_rows(pool)
    assert not uniform_rows([pool[0], torch.zeros(4, 4, dtype=torch.int64)])
    assert not uniform_rows([pool[0], pool[1][:, :4]])  # rows not contiguous


@pytest.mark.parametrize("lanes", [1, 2])
def test_the_tier_s_batched_path_in_one_launch_moves_what_its_per_buffer_path_moves(lanes) -> None:
    """StagedCopies with `one_launch` (a GPU's default): written to the host and loaded back into
    other pages, every buffer's rows arrive as through a launch per buffer, over several chunks."""
    from snugkv.memory.tier_copies import StagedCopies
    from tests.host_tier.held_copies import staging_for

    generator = torch.Generator().manual_seed(3)
    rows, host_pages_total = [48, 48, 48], 16
    page_bytes = sum(rows)
    source = torch.tensor([8, 1, 4, 30, 31, 17, 2])
    host_pages = torch.arange(1, source.numel() + 1)
    target = torch.tensor([33, 34, 35, 36, 37, 20, 21])
    results = []
    for one_launch in (True, False):
        views = [
            torch.randint(0, 256, (40, row), dtype=torch.uint8, generator=generator.manual_seed(3))
            for row in rows
        ]
        host = torch.zeros((host_pages_total + 1) * page_bytes, dtype=torch.uint8)
        path = StagedCopies(
            views, host, host_pages_total, staging_for(4, page_bytes), lanes=lanes, one_launch=one_launch
        )
        assert ("one launch for all buffers" in path.describe()) == one_launch
        expected = [view[source].clone() for view in views]
        path.write(source, host_pages)()
        path.load(host_pages, target)()
        assert all(torch.equal(view[target], want) for view, want in zip(views, expected))
        results.append((host.clone(), [view.clone() for view in views]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
