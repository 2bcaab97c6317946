"""The host KV tier at start-up: how big (`--kv-host-tier-gib`, or a default that leaves the host
room), in pinned host memory, or none at all.

Off unless `--kv-host-tier-gib N` asks (on CPU the 'device' is host memory already; tests turn it
on to run the same code; on a GPU for its start-up cost, see `host_tier_bytes`); the start-up
log suggests a size that leaves the host room: `HOST_TIER_RAM_FRACTION` of the host RAM available,
split over the ranks of this launch (each rank pins its own), at most `HOST_TIER_DEFAULT_MAX_GIB`.
Every rank keeps the same number of pages (MIN over ranks), so every rank spills and loads alike,
and the same write bandwidth (a timed copy of up to 64 MiB of pages at start-up, MIN over ranks),
from which a pressure move's time budget becomes the pages it may spill.
A pinned allocation that fails is one warning line and no tier: the engine serves as without it.
Copies go through a fixed staging buffer on the device (`allocate_staging`, `STAGING_BYTES`),
allocated before the KV cache is sized, so the sizing measures the memory without it and nothing
is allocated on the device while serving (issue 36); the ledger shows it as a row of its own. Without
one (its allocation failed, or a page does not fit it) the tier copies per run of pages (slower).
The tier follows the prefix cache's page layout, so a pool of two token groups (sliding window)
gets none (not built yet), and says so.

This module sizes and allocates the tier once; what moves through it is the prefix cache's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from snugkv.engine.args import EngineArgs
from snugkv.memory.host_tier import HostCopies, HostKvTier, PageCopies, StreamCopies
from snugkv.memory.kv_pool import KVPool
from snugkv.memory.tier_copies import STAGING_BYTES, chunk_pages_of
from snugkv.memory.vmm import GIB
from snugkv.memory.vmm_host import available_ram_bytes
from snugkv.sizing.measure import agree_min

logger = logging.getLogger(__name__)

HOST_TIER_RAM_FRACTION = 0.25  # of the host RAM available at start-up, over the ranks of the launch
HOST_TIER_DEFAULT_MAX_GIB = 64.0  # per rank, by default; --kv-host-tier-gib sets any size


def suggested_host_tier_bytes(ranks: int) -> int:
    """A size that leaves the host room: `HOST_TIER_RAM_FRACTION` of the RAM available now over the
    ranks, at most `HOST_TIER_DEFAULT_MAX_GIB` each."""
    return min(
        int(available_ram_bytes() * HOST_TIER_RAM_FRACTION / ranks), int(HOST_TIER_DEFAULT_MAX_GIB * GIB)
    )


def host_tier_bytes(args: EngineArgs, device: torch.device, ranks: int) -> tuple[int, str]:
    """The tier's size in bytes (0: none) and where the figure comes from, for the log line.

    Off unless `--kv-host-tier-gib` asks for it, on a GPU too: pinning its 64 GiB took 6-7 s of
    start-up on the H100 (1ba959b), where the whole cold start is ~24 s, and it pays only when the
    prefixes outgrow the device (chat at 3x the device KV: 1.74x tok/s; docs/HOST_TIER.md)."""
    if args.cache.kv_host_tier_gib is not None:
        return int(args.cache.kv_host_tier_gib * GIB), "--kv-host-tier-gib"
    if device.type != "cuda":
        return 0, "off on CPU by default"
    size = suggested_host_tier_bytes(ranks)
    over = f" over {ranks} ranks" if ranks > 1 else ""
    return 0, (
        f"off by default; --kv-host-tier-gib N turns it on ({size / GIB:.1f} GiB would be "
        f"{HOST_TIER_RAM_FRACTION:.0%} of the host RAM available{over}, at most {HOST_TIER_DEFAULT_MAX_GIB:g} GiB)"
    )


def allocate_staging(args: EngineArgs, device: torch.device, ranks: int) -> torch.Tensor | None:
    """The host tier's copy staging on `device` (`STAGING_BYTES`), when the tier is asked for; call
    it before the KV cache is sized, which then counts it. None when the tier is off, or when the
    allocation fails (one warning line: the tier then copies per run of pages)."""
    if host_tier_bytes(args, device, ranks)[0] <= 0:
        return None
    try:
        return torch.empty(STAGING_BYTES, dtype=torch.uint8, device=device)
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        logger.warning(
            "Host KV tier: no copy staging (allocating %.0f MiB failed: %s); it copies per run of pages",
            STAGING_BYTES / 2**20,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        return None


def open_host_tier(
    args: EngineArgs,
    pool: KVPool,
    device: torch.device,
    *,
    ranks: int,
    group: dist.ProcessGroup | None,
    log: Callable[..., Any],
    copies: PageCopies | None = None,
    staging: torch.Tensor | None = None,
) -> HostKvTier | None:
    """The host tier for `pool`, or None (off, too small, not built for this pool, or pinning
    failed: one line says which). `copies`: when pages are copied (default: the device's own);
    `staging`: what they are copied through (`allocate_staging`; None: per run of pages)."""
    size_bytes, why = host_tier_bytes(args, device, ranks)
    if size_bytes <= 0:
        return None
    try:
        views = pool.page_views()
    except ValueError as exc:
        log("Host KV tier off: %s (not built for it yet)", exc)
        return None
    page_bytes = sum(view.shape[1] for view in views)
    pages = agree_min(size_bytes // page_bytes, group)
    if pages < 1:
        log("Host KV tier off: %.3f GiB hold no KV page of %d bytes (%s)", size_bytes / GIB, page_bytes, why)
        return None
    if staging is not None and chunk_pages_of(staging.numel(), page_bytes) < 1:
        log("Host KV tier: a page of %d bytes does not fit the copy staging; it copies per run", page_bytes)
        staging = None
    pin = device.type == "cuda"
    started = time.perf_counter()
    tier: HostKvTier | None = None
    try:
        tier = HostKvTier(
            views,
            num_pages=pages,
            page_size=pool.page_size,
            copies=copies or (StreamCopies(device) if pin else HostCopies()),
            pin_memory=pin,
            staging=staging,
        )
    except (RuntimeError, MemoryError) as exc:
        logger.warning(
            "Host KV tier off: allocating %.2f GiB of %s host memory failed (%s); serving without it",
            pages * page_bytes / GIB,
            "pinned" if pin else "plain",
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
    if agree_min(int(tier is not None), group) == 0:  # every rank has one, or none does
        if tier is not None:
            tier.close()
        return None
    assert tier is not None
    # What a pressure move's time budget may spill is counted at this bandwidth: every rank the same.
    probed = tier.probe_write_bytes_per_s(pool.committed_tokens // pool.page_size)
    agreed = agree_min(-1 if probed is None else int(probed), group)
    tier.write_bytes_per_s = None if agreed < 0 else float(agreed)
    log(
        "Host KV tier: %.2f GiB of %s host memory, %d tokens (%d pages of %.2f MiB) beside %d on the device "
        "(%s), writes at %s (%s), took %.0f ms",
        tier.capacity_bytes / GIB,
        "pinned" if pin else "plain",
        tier.capacity_tokens,
        tier.capacity_pages,
        page_bytes / 2**20,
        pool.committed_tokens,
        why,
        "?" if tier.write_bytes_per_s is None else f"{tier.write_bytes_per_s / 1e9:.1f} GB/s",
        tier.copy_path_text,
        (time.perf_counter() - started) * 1000,
    )
    return tier
