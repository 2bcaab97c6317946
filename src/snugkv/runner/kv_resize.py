"""Changing a serving runner's KV cache: grow, shrink under live requests, release.

Every step keeps the captured graphs valid: buffers keep their addresses, and graphs read slots
through the request-to-token table, which a shrink rewrites. The order makes failures harmless:
a grow commits before the allocator hands anything out (all or nothing); a shrink copies the moved
pages first (sources untouched, destinations still free), then updates the bookkeeping, then
decommits. Which requests to evict or retract so that a shrink fits is the scheduler's policy
(snugkv.scheduler.elastic); the token count is the engine's KV sizing object's
(snugkv.engine.kv_sizing, which also backs the cache again on wake). This module only moves memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from snugkv.memory.moves import KvMoves, PageMoves
from snugkv.runner.model_runner import ModelRunner


class ShrinkDoesNotFit(ValueError):
    """More pages are in use than the smaller cache holds; free some first (the message says how many)."""


@dataclass(frozen=True, slots=True)
class MoveStats:
    """What a shrink moved: pages of the full pool and of a window sub-pool, and the KV bytes copied."""

    moved_pages: int = 0
    moved_window_pages: int = 0
    copied_bytes: int = 0


def grow(runner: ModelRunner, num_tokens: int) -> None:
    """Back `num_tokens` and let the allocator hand them out; a `CommitError` changes nothing."""
    backed = runner.kv_pool.finalize_backing(num_tokens)
    runner.allocator.resize(backed)


def shrink(
    runner: ModelRunner, num_tokens: int, on_move: Callable[[KvMoves], None] | None = None
) -> MoveStats:
    """Move every page in use above `num_tokens` below it, then decommit the rest.

    `on_move` rewrites the slots other holders name (the prefix cache); the request-to-token table
    is rewritten here. Raises `ShrinkDoesNotFit`, with nothing changed, when the pages in use do
    not fit below the new bound.
    """
    allocator = runner.allocator
    plan = allocator.plan_shrink(num_tokens)
    if plan is None:
        in_use = allocator.capacity_tokens - allocator.available_tokens
        raise ShrinkDoesNotFit(
            f"{in_use} KV tokens are in use (requests and the prefix cache), more than {num_tokens} "
            "hold; free some (evict the cache, retract requests) before shrinking"
        )
    copied = runner.kv_pool.move_pages(plan)
    allocator.apply_moves(plan)
    runner.req_to_token_pool.remap_slots(plan.full, runner.kv_pool.page_size)
    if on_move is not None:
        on_move(plan)
    allocator.resize(num_tokens)
    runner.kv_pool.finalize_backing(num_tokens)
    return MoveStats(plan.full.num_pages, plan.window.num_pages, copied)


def load_shrink_kernels(runner: ModelRunner) -> None:
    """Run a shrink's copy and remap on the dummy page (page 0 onto itself) once, at start-up.

    A pressure shrink runs when another process has taken the driver's free memory; the first
    launch of a kernel loads its module (CUDA loads modules lazily), which needs device memory
    then. Loaded here, before the KV cache is sized, they cost nothing later.
    """
    still = PageMoves(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    runner.kv_pool.move_pages(KvMoves(full=still, window=still))
    table = runner.req_to_token_pool.req_to_token
    still.remap_slots(torch.zeros(1, dtype=table.dtype, device=table.device), runner.kv_pool.page_size)


def release(runner: ModelRunner) -> int:
    """Decommit the whole KV cache, the dummy page included (the engine sleeps); every slot must be
    free. Returns the bytes released."""
    runner.allocator.resize(0)
    return runner.kv_pool.release_backing()
