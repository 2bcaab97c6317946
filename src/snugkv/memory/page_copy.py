"""Page rows of every KV buffer to and from a staging chunk, in one launch for all buffers.

The host tier's batched copy path (tier_copies.py) moves pages through a device staging
chunk of `[pages, page words]`, where a staged page holds its row of buffer 0, then of buffer 1, and
so on (`row_words` each). Gathering or scattering a chunk with torch takes one `index_select` /
`index_copy_` per buffer: 32 launches a chunk for the Llama-3-8B shape (a buffer per layer), paid on
the scheduler's thread for every chunk of every load and write. These kernels take the buffers'
base addresses from a device table (the pool's buffers sit at fixed virtual addresses in the KV
arena, so the table is made once) and move every buffer's rows of the chunk in one launch, grid
`(pages, buffers, row blocks)`. They need every buffer's rows of one length and contiguous (`[pool
pages, row words]` views); the caller checks (`uniform_rows`) and keeps the per-buffer path
otherwise. Imports nothing from snugkv.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # words a program moves


def uniform_rows(device_views: list[torch.Tensor]) -> bool:
    """Whether one launch can address these `[pool pages, row words]` buffers: same dtype and row
    length, rows contiguous."""
    if not device_views:
        return False
    first = device_views[0]
    return all(
        view.dim() == 2
        and view.dtype == first.dtype
        and view.shape[1] == first.shape[1]
        and view.stride() == (first.shape[1], 1)
        for view in device_views
    )


def buffer_table(device_views: list[torch.Tensor]) -> torch.Tensor:
    """The buffers' base addresses, as an int64 tensor on their device."""
    return torch.tensor(
        [view.data_ptr() for view in device_views], dtype=torch.int64, device=device_views[0].device
    )


@triton.jit
def _pages_kernel(Staged, Index, Table, row_words, TO_STAGING: tl.constexpr, BLOCK_WORDS: tl.constexpr):
    page = tl.program_id(0).to(tl.int64)
    buffer = tl.program_id(1).to(tl.int64)
    words = tl.program_id(2).to(tl.int64) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
    mask = words < row_words
    base = tl.load(Table + buffer).to(tl.pointer_type(Staged.dtype.element_ty))
    pool_page = tl.load(Index + page).to(tl.int64)
    pool = base + pool_page * row_words + words
    staged = Staged + (page * tl.num_programs(1) + buffer) * row_words + words
    if TO_STAGING:
        tl.store(staged, tl.load(pool, mask=mask), mask=mask)
    else:
        tl.store(pool, tl.load(staged, mask=mask), mask=mask)


def _launch(
    staged: torch.Tensor, index: torch.Tensor, table: torch.Tensor, row_words: int, to_staging: bool
) -> None:
    pages = int(index.numel())
    if pages == 0:
        return
    if staged.dim() != 2 or staged.shape[1] != table.numel() * row_words or staged.shape[0] < pages:
        raise ValueError(
            f"a staging chunk of shape {tuple(staged.shape)} does not hold {pages} pages of "
            f"{table.numel()} rows of {row_words} words"
        )
    grid = (pages, int(table.numel()), triton.cdiv(row_words, BLOCK))
    _pages_kernel[grid](staged, index, table, row_words, TO_STAGING=to_staging, BLOCK_WORDS=BLOCK)


def gather_pages(staged: torch.Tensor, index: torch.Tensor, table: torch.Tensor, row_words: int) -> None:
    """`staged[i]` = page `index[i]`'s rows of every buffer in `table`, side by side."""
    _launch(staged, index, table, row_words, to_staging=True)


def scatter_pages(staged: torch.Tensor, index: torch.Tensor, table: torch.Tensor, row_words: int) -> None:
    """Page `index[i]` of every buffer in `table` = its row in `staged[i]`."""
    _launch(staged, index, table, row_words, to_staging=False)
