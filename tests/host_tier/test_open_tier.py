"""Opening the host tier at start-up: its size (the flag, or a default that leaves the host room;
none on CPU unless asked), and a failed allocation that leaves the engine without a tier after one
warning line."""

from __future__ import annotations

import logging

import torch

from snugkv.core.reports import MemoryLedger
from snugkv.engine import EngineArgs
from snugkv.engine.host_tier import (
    HOST_TIER_DEFAULT_MAX_GIB,
    HOST_TIER_RAM_FRACTION,
    allocate_staging,
    host_tier_bytes,
    open_host_tier,
    suggested_host_tier_bytes,
)
from snugkv.memory.kv_pool import MHAKVPool
from snugkv.memory.tier_copies import STAGING_BYTES
from snugkv.memory.vmm import GIB, MIB
from snugkv.memory.vmm_host import available_ram_bytes
from tests.host_tier.held_copies import staging_for
from tests.memory.test_kv_pools import make_pool


def small_pool(kind: str = "mha") -> MHAKVPool:
    return make_pool(kind, dtype="float32", page_size=4, layout="nhd", reserved_tokens=64, mode="static")  # type: ignore[return-value]


def test_the_tier_is_off_unless_asked_and_the_log_suggests_a_size_that_leaves_the_host_room():
    assert host_tier_bytes(EngineArgs.of(), torch.device("cpu"), ranks=1)[0] == 0
    size, why = host_tier_bytes(EngineArgs.of(), torch.device("cuda"), ranks=4)
    assert size == 0
    suggested = min(
        int(available_ram_bytes() * HOST_TIER_RAM_FRACTION / 4), int(HOST_TIER_DEFAULT_MAX_GIB * GIB)
    )
    assert abs(suggested_host_tier_bytes(4) - suggested) < 64 * MIB  # available RAM moves a little
    assert "over 4 ranks" in why and "--kv-host-tier-gib" in why
    assert host_tier_bytes(EngineArgs.of(kv_host_tier_gib=0.5), torch.device("cpu"), ranks=1)[0] == GIB // 2
    assert host_tier_bytes(EngineArgs.of(kv_host_tier_gib=0.5), torch.device("cuda"), ranks=1)[0] == GIB // 2


def test_a_failed_allocation_leaves_no_tier_and_one_warning(caplog):
    pool = small_pool()
    lines: list[str] = []
    with caplog.at_level(logging.WARNING, logger="snugkv.engine.host_tier"):
        tier = open_host_tier(
            EngineArgs.of(kv_host_tier_gib=1e9),
            pool,
            torch.device("cpu"),
            ranks=1,
            group=None,
            log=lines.append,
        )
    assert tier is None and not lines
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Host KV tier off" in warnings[0].getMessage()
    assert "serving without it" in warnings[0].getMessage()


def test_a_sliding_window_pool_gets_no_tier_and_says_why():
    lines: list[object] = []
    tier = open_host_tier(
        EngineArgs.of(kv_host_tier_gib=0.01),
        small_pool("swa"),  # type: ignore[arg-type]
        torch.device("cpu"),
        ranks=1,
        group=None,
        log=lambda *args: lines.append(args),
    )
    assert tier is None and "Host KV tier off" in str(lines[0][0])


def test_the_tier_holds_whole_pages_of_every_buffer():
    pool = small_pool()
    lines: list[object] = []
    tier = open_host_tier(
        EngineArgs.of(kv_host_tier_gib=1 / 1024), pool, torch.device("cpu"), ranks=1, group=None,
        log=lambda *args: lines.append(args),
    )  # fmt: skip
    assert tier is not None
    page_bytes = 2 * 2 * 4 * 3 * 24 * 4  # two layers, K and V, four slots of 3 heads x 24 floats
    assert tier.page_bytes == page_bytes and tier.capacity_pages == MIB // page_bytes
    assert "Host KV tier:" in str(lines[0][0])


def test_the_staging_is_allocated_only_for_a_tier_and_the_tier_copies_through_it():
    assert allocate_staging(EngineArgs.of(), torch.device("cpu"), ranks=1) is None
    args = EngineArgs.of(kv_host_tier_gib=1 / 1024)
    staging = allocate_staging(args, torch.device("cpu"), ranks=1)
    assert staging is not None and staging.numel() == STAGING_BYTES
    lines: list[object] = []
    tier = open_host_tier(args, small_pool(), torch.device("cpu"), ranks=1, group=None,
                          log=lambda *args: lines.append(args), staging=staging)  # fmt: skip
    assert tier is not None and tier.path.name == "batched" and tier.staging_bytes == STAGING_BYTES
    assert "batched through 64 MiB" in str(lines[-1])


def test_a_staging_too_small_for_a_page_leaves_the_tier_copying_per_run_and_says_so():
    pool = small_pool()
    page_bytes = sum(view.shape[1] for view in pool.page_views())
    lines: list[object] = []
    tier = open_host_tier(
        EngineArgs.of(kv_host_tier_gib=1 / 1024), pool, torch.device("cpu"), ranks=1, group=None,
        log=lambda *args: lines.append(args), staging=staging_for(1, page_bytes)[:-1],
    )  # fmt: skip
    assert tier is not None and tier.path.name == "per-run" and tier.staging_bytes == 0
    assert "does not fit the copy staging" in str(lines[0][0])


def test_the_staging_is_a_ledger_row_within_the_devices_total():
    gib = 1 << 30
    ledger = MemoryLedger(
        "cuda", 80 * gib, gib, gib, weights_bytes=16 * gib, graphs_and_buffers_bytes=gib,
        kv_committed_bytes=60 * gib, kv_reserved_va_bytes=80 * gib, activation_peak_bytes=gib,
        headroom_bytes=gib, host_tier_staging_bytes=64 * MIB,
    )  # fmt: skip
    rows = dict(ledger.total_rows())
    assert rows["KV host tier copy staging (torch allocator)"] == 64 * MIB
    assert sum(rows.values()) == ledger.total_bytes
    assert ledger.unaccounted_bytes == gib - 64 * MIB
