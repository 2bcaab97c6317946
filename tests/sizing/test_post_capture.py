"""Post-capture sizing over the host backend: budget math, retry on a failed commit, MIN over ranks."""

from __future__ import annotations

import logging
import os
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from snugkv.memory.arena import KvArena
from snugkv.memory.kv_pool import KVPoolSpec, MHAKVPool
from snugkv.memory.vmm import MIB
from snugkv.memory.vmm_host import HostVmm
from snugkv.sizing.measure import measure_free
from snugkv.sizing.post_capture import SizingError, recap_running_requests, size_post_capture

GRANULE = 2 * MIB


def make_pool(capacity_bytes: int, page_size: int = 16) -> MHAKVPool:
    arena = KvArena(
        HostVmm(granularity_bytes=GRANULE, capacity_bytes=capacity_bytes), 64 * 1024 * MIB, label="sizing"
    )
    pool = MHAKVPool(
        KVPoolSpec.of(dtype="float32", page_size=page_size, layout="hnd", device="cpu", mode="post-capture"),
        reserved_tokens=1_000_000,
        num_layers=4,
        num_kv_heads=2,
        head_dim=64,
        arena=arena,
    )
    pool.ensure_prefix()
    return pool


def test_sizing_fills_free_memory_less_headroom_within_one_granule_per_buffer():
    pool = make_pool(capacity_bytes=256 * MIB)
    free = measure_free(pool.arena.vmm)
    result = size_post_capture(pool, free, headroom_bytes=32 * MIB)
    left = pool.arena.vmm.mem_get_info()[0]
    assert result.max_total_num_tokens > 0 and result.retries == 0
    assert left >= 32 * MIB
    assert (
        left - 32 * MIB < 8 * GRANULE + pool.bytes_per_token * pool.page_size
    )  # nothing wasted beyond rounding


@pytest.mark.slow
def test_user_cap_and_virtual_upper_bound_both_limit_the_count():
    pool = make_pool(capacity_bytes=256 * MIB)
    free = measure_free(pool.arena.vmm)
    assert size_post_capture(pool, free, 0, max_total_tokens=1000).max_total_num_tokens == 992
    big = make_pool(capacity_bytes=1 << 40)
    free = measure_free(big.arena.vmm)
    capped = size_post_capture(big, free, 0)
    assert capped.max_total_num_tokens == big.reserved_tokens


def test_commit_retries_with_fewer_tokens_when_memory_vanished(caplog):
    pool = make_pool(capacity_bytes=256 * MIB)
    vmm = pool.arena.vmm
    free = measure_free(vmm)
    thief_base = vmm.reserve(32 * MIB)
    vmm.commit(thief_base, 16 * MIB)  # another user takes memory between measure and commit
    with caplog.at_level(logging.WARNING):
        result = size_post_capture(pool, free, headroom_bytes=0)
    assert result.retries >= 1
    assert "retrying with fewer tokens" in caplog.text
    assert pool.committed_tokens == result.max_total_num_tokens > 0
    assert pool.committed_bytes == pool.bytes_for_tokens(result.max_total_num_tokens)


def test_no_memory_left_raises_a_sentence_that_says_what_to_change():
    pool = make_pool(capacity_bytes=64 * MIB)
    free = measure_free(pool.arena.vmm)
    with pytest.raises(SizingError, match="--cuda-graph-max-bs"):
        size_post_capture(pool, free, headroom_bytes=1 << 30)


def test_running_requests_are_recapped_to_the_pages_the_pool_holds(caplog):
    with caplog.at_level(logging.WARNING):
        assert recap_running_requests(256, max_total_num_tokens=1024, page_size=16) == 64
    assert "lowered from 256 to 64" in caplog.text
    assert recap_running_requests(8, max_total_num_tokens=1024, page_size=16) == 8


def _rank_main(rank: int, world: int, port: int, capacities: list[int], results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        pool = make_pool(capacity_bytes=capacities[rank])
        free = measure_free(pool.arena.vmm, group=dist.group.WORLD)
        result = size_post_capture(pool, free, headroom_bytes=0, group=dist.group.WORLD)
        results[rank] = (result.max_total_num_tokens, free.per_rank_bytes)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_every_rank_commits_the_min_over_ranks():
    capacities = [128 * MIB, 256 * MIB]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(2, free_port(), capacities, results), nprocs=2, join=True)
        outcome = dict(results)
    tokens = {rank: value[0] for rank, value in outcome.items()}
    assert tokens[0] == tokens[1] > 0
    assert len(outcome[0][1]) == 2 and outcome[0][1][0] < outcome[0][1][1]
    solo = make_pool(capacity_bytes=128 * MIB)
    assert tokens[0] == size_post_capture(solo, measure_free(solo.arena.vmm), 0).max_total_num_tokens
