"""Sorting routed rows by expert, in blocks, with no host synchronisation.

A layer with `T` tokens and `k` experts per token has `T * k` routed rows; row `r = t * k + j` is
token t's j-th expert. The grouped GEMMs (moe_experts.py) take the rows sorted by expert in blocks
of `block_m`: each expert's rows are padded to a multiple of `block_m`, so every block belongs to
one expert. This module owns that layout (`ExpertBlocks`):
- `sorted_rows [max_padded_rows]` int32: routed row ids, expert by expert; padding holds `T * k`
  (no row), and so does everything past the used part;
- `block_experts [max_blocks]` int32: the expert of each block, -1 past the used blocks;
- `num_padded [1]` int32: how many sorted rows are in use (a multiple of `block_m`), on the device.

Every size is the worst case for `T`, `k`, E and `block_m` (`max_padded_rows`), never the routing's:
the buffers, and so the memory a step takes, depend on the token count alone, and a CUDA graph
(decode or piecewise) replays any routing. Kernels read `num_padded` on the device and skip the
blocks past it.

Two Triton paths:
- `route_and_align_small`: one program selects the experts of a small batch (a decode step) and
  sorts them, in one launch; rows of an expert land in the order the program's atomics hand out;
- `align_triton`: any number of rows over several programs (count, plan, scatter).
`align_reference` is the same layout in torch (rows of an expert in ascending order), the oracle
the kernels are tested against. Within an expert's blocks the order of rows never changes a result:
each output row depends on its own input row only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from snugkv.kernels.moe_routing import Routing, load_logits, routing_constants, select_topk

_CHUNK = 1024  # rows per vector in the sorting loops
_BLOCK_CHUNK = 128  # blocks per vector when the blocks' experts are written
_SMALL_BLOCK_TOKENS = 16  # token rows per selection step of the one-program path, at most


@dataclass(frozen=True, slots=True)
class ExpertBlocks:
    """Routed rows sorted by expert in blocks of `block_m` (see the module docstring)."""

    sorted_rows: torch.Tensor
    block_experts: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    num_rows: int

    @property
    def max_blocks(self) -> int:
        return self.block_experts.shape[0]


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """The most sorted rows `num_rows` routed rows can need: each expert that has any rows pads
    them by at most `block_m - 1`, and at most `min(E, num_rows)` experts have rows."""
    bound = num_rows + min(num_experts, num_rows) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def _empty_blocks(num_rows: int, num_experts: int, block_m: int, device: torch.device) -> ExpertBlocks:
    padded = max_padded_rows(num_rows, num_experts, block_m)
    return ExpertBlocks(
        sorted_rows=torch.empty(padded, dtype=torch.int32, device=device),
        block_experts=torch.empty(padded // block_m, dtype=torch.int32, device=device),
        num_padded=torch.empty(1, dtype=torch.int32, device=device),
        block_m=block_m,
        num_rows=num_rows,
    )


def align_reference(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """The layout in plain torch (no host sync either): a stable sort, rows ascending per expert."""
    flat = ids.reshape(-1).long()
    num_rows = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices
    experts_in_order = flat[order]
    rank = torch.arange(num_rows, device=device) - (counts.cumsum(0) - counts)[experts_in_order]
    blocks = _empty_blocks(num_rows, num_experts, block_m, device)
    blocks.sorted_rows.fill_(num_rows)
    blocks.sorted_rows[(ends - padded)[experts_in_order] + rank] = order.to(torch.int32)
    first_rows = torch.arange(blocks.max_blocks, device=device) * block_m
    experts = torch.searchsorted(ends, first_rows, right=True)
    blocks.block_experts.copy_(torch.where(first_rows < ends[-1], experts, -1))
    blocks.num_padded.copy_(ends[-1:])
    return blocks


@triton.jit
def _plan(
    counts,
    bins,
    Cursor,
    BlockExperts,
    NumPadded,
    SortedRows,
    num_experts,
    num_rows,
    max_padded,
    max_blocks,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr,
):
    """From per-expert row counts: each expert's first sorted row into Cursor, the blocks' experts,
    the used row count, and every sorted row set to `num_rows` (no row) before the scatter."""
    counts = tl.where(bins < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    tl.store(Cursor + bins, ends - padded, mask=bins < num_experts)
    tl.store(NumPadded, total)
    for b0 in range(0, max_blocks, BLOCK_CHUNK):
        blocks = b0 + tl.arange(0, BLOCK_CHUNK)
        first = blocks * BLOCK_M
        before = (ends[None, :] <= first[:, None]) & (bins[None, :] < num_experts)
        expert = tl.sum(before.to(tl.int32), axis=1)
        tl.store(BlockExperts + blocks, tl.where(first < total, expert, -1), mask=blocks < max_blocks)
    for r0 in range(0, max_padded, CHUNK):
        rows = r0 + tl.arange(0, CHUNK)
        tl.store(SortedRows + rows, tl.zeros([CHUNK], dtype=tl.int32) + num_rows, mask=rows < max_padded)


@triton.jit
def _scatter(Ids, Cursor, SortedRows, first, num_rows, CHUNK: tl.constexpr):
    rows = first + tl.arange(0, CHUNK)
    ok = rows < num_rows
    expert = tl.load(Ids + rows, mask=ok, other=0)
    slot = tl.atomic_add(Cursor + expert, 1, mask=ok)
    tl.store(SortedRows + slot, rows, mask=ok)


@triton.jit
def _route_align_small_kernel(
    Logits,
    Weights,
    Ids,
    SortedRows,
    BlockExperts,
    NumPadded,
    Cursor,
    num_tokens,
    num_experts,
    stride_logits,
    scale,
    max_padded,
    max_blocks,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    COLS: tl.constexpr,
    BINS: tl.constexpr,
    RENORM: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr,
):
    cols = tl.arange(0, COLS)
    bins = tl.arange(0, BINS)
    kcols = tl.arange(0, K_PAD)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for t0 in range(0, num_tokens, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        tile = load_logits(Logits, rows, cols, num_tokens, num_experts, stride_logits)
        weights, ids = select_topk(
            tile, cols, num_experts, scale, K, K_PAD, RENORM, NUM_GROUPS, GROUPS_PAD, TOPK_GROUPS
        )
        out = rows[:, None] * K + kcols[None, :]
        ok = (rows[:, None] < num_tokens) & (kcols[None, :] < K)
        tl.store(Weights + out, weights, mask=ok)
        tl.store(Ids + out, ids, mask=ok)
        binned = tl.where(ok, ids, num_experts)  # the spare bin: rows and columns past the batch
        counts += tl.histogram(tl.reshape(binned, [BLOCK_T * K_PAD]), BINS)
    num_rows = num_tokens * K
    _plan(
        counts,
        bins,
        Cursor,
        BlockExperts,
        NumPadded,
        SortedRows,
        num_experts,
        num_rows,
        max_padded,
        max_blocks,
        BLOCK_M,
        CHUNK,
        BLOCK_CHUNK,
    )
    tl.debug_barrier()  # the ids, the cursors and the filled rows are seen by every thread
    for r0 in range(0, num_rows, CHUNK):
        _scatter(Ids, Cursor, SortedRows, r0, num_rows, CHUNK)


@triton.jit
def _count_kernel(Ids, Counts, num_rows, num_experts, BINS: tl.constexpr, CHUNK: tl.constexpr):
    rows = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    expert = tl.load(Ids + rows, mask=rows < num_rows, other=num_experts)
    bins = tl.arange(0, BINS)
    tl.atomic_add(Counts + bins, tl.histogram(expert, BINS), mask=bins < num_experts)


@triton.jit
def _plan_kernel(
    Counts,
    Cursor,
    BlockExperts,
    NumPadded,
    SortedRows,
    num_experts,
    num_rows,
    max_padded,
    max_blocks,
    BINS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr,
):
    bins = tl.arange(0, BINS)
    counts = tl.load(Counts + bins, mask=bins < num_experts, other=0)
    _plan(
        counts,
        bins,
        Cursor,
        BlockExperts,
        NumPadded,
        SortedRows,
        num_experts,
        num_rows,
        max_padded,
        max_blocks,
        BLOCK_M,
        CHUNK,
        BLOCK_CHUNK,
    )


@triton.jit
def _scatter_kernel(Ids, Cursor, SortedRows, num_rows, CHUNK: tl.constexpr):
    _scatter(Ids, Cursor, SortedRows, tl.program_id(0) * CHUNK, num_rows, CHUNK)


def align_triton(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Routed rows `ids [T, k]` int32 sorted by expert: count, plan, scatter (three launches)."""
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        raise ValueError(f"expert ids must be contiguous int32, got {ids.dtype} strides {ids.stride()}")
    num_rows = ids.numel()
    blocks = _empty_blocks(num_rows, num_experts, block_m, ids.device)
    bins = triton.next_power_of_2(num_experts + 1)
    counts = torch.zeros(bins, dtype=torch.int32, device=ids.device)
    cursor = torch.empty(bins, dtype=torch.int32, device=ids.device)
    grid = (max(triton.cdiv(num_rows, _CHUNK), 1),)
    _count_kernel[grid](ids, counts, num_rows, num_experts, BINS=bins, CHUNK=_CHUNK)
    _plan_kernel[(1,)](
        counts,
        cursor,
        blocks.block_experts,
        blocks.num_padded,
        blocks.sorted_rows,
        num_experts,
        num_rows,
        blocks.sorted_rows.shape[0],
        blocks.max_blocks,
        BINS=bins,
        BLOCK_M=block_m,
        CHUNK=_CHUNK,
        BLOCK_CHUNK=_BLOCK_CHUNK,
    )
    _scatter_kernel[grid](ids, cursor, blocks.sorted_rows, num_rows, CHUNK=_CHUNK)
    return blocks


def route_and_align_small(
    logits: torch.Tensor, routing: Routing, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, ExpertBlocks]:
    """Select experts for every row of `logits [T, E]` and sort the routed rows, in one program:
    (weights float32 [T, k], ids int32 [T, k], blocks). For small T (a decode batch), where one
    launch costs less than the parallel path's four.

    The program's vectors are sized by the batch (powers of two up to the parallel path's
    chunks): at 8 tokens it selects over 8 rows, not 16, and places 64 blocks, not 128, so a
    small batch's one serial program does a small batch's work. One compiled variant per size
    bucket: for 128 experts, k=8 and 16-row blocks 1, 2, 3-4, 5-8 tokens, then the caps from 9."""
    num_tokens = logits.shape[0]
    device = logits.device
    weights = torch.empty(num_tokens, routing.top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, routing.top_k, dtype=torch.int32, device=device)
    blocks = _empty_blocks(num_tokens * routing.top_k, routing.num_experts, block_m, device)
    cursor = torch.empty(routing.expert_bins, dtype=torch.int32, device=device)
    token_rows = max(1, min(_SMALL_BLOCK_TOKENS, 2048 // routing.expert_cols))
    _route_align_small_kernel[(1,)](
        logits,
        weights,
        ids,
        blocks.sorted_rows,
        blocks.block_experts,
        blocks.num_padded,
        cursor,
        num_tokens,
        routing.num_experts,
        logits.stride(0),
        float(routing.scale),
        blocks.sorted_rows.shape[0],
        blocks.max_blocks,
        **routing_constants(routing),
        BINS=routing.expert_bins,
        BLOCK_T=min(token_rows, triton.next_power_of_2(num_tokens)),
        BLOCK_M=block_m,
        CHUNK=min(_CHUNK, triton.next_power_of_2(blocks.sorted_rows.shape[0])),
        BLOCK_CHUNK=min(_BLOCK_CHUNK, triton.next_power_of_2(blocks.max_blocks)),
        num_warps=4,
    )
    return weights, ids, blocks
