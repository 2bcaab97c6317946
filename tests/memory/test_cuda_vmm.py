"""CUDA VMM on a real GPU (run on the device by scripts/gpu_check.sh; skipped on CPU)."""

from __future__ import annotations

import gc

import pytest
import torch

from snugkv.memory.arena import SHRINK_EXCESS_BYTES, KvArena, auto_chunk_bytes
from snugkv.memory.kv_pool import KVPoolSpec, MHAKVPool
from snugkv.memory.vmm import GIB, MIB, CommitError
from snugkv.memory.vmm_factory import create_vmm

pytestmark = pytest.mark.cuda


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.fixture
def vmm():
    return create_vmm("cuda")


def test_cuda_backend_reports_a_2mib_class_granularity(vmm):
    assert vmm.name == "cuda"
    assert vmm.granularity_bytes >= 2 * MIB and vmm.granularity_bytes % (2 * MIB) == 0


def test_reserving_256_gib_leaves_free_memory_unchanged(vmm):
    before = free_bytes()
    base = vmm.reserve(256 * GIB)
    assert abs(before - free_bytes()) <= 2 * MIB
    vmm.release(base, 256 * GIB)


def make_pool(vmm, mode: str, layout: str = "nhd", page_size: int = 1) -> MHAKVPool:
    chunk = auto_chunk_bytes(64, vmm.granularity_bytes)  # what a pool that makes its arena picks
    arena = KvArena(vmm, 256 * GIB, label="cuda-test", chunk_bytes=chunk)
    return MHAKVPool(
        KVPoolSpec.of(dtype="bfloat16", page_size=page_size, layout=layout, device="cuda", mode=mode),
        reserved_tokens=400_000,
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        arena=arena,
    )


def test_va_only_pool_costs_nothing_and_finalize_costs_exactly_what_it_backs(vmm):
    before = free_bytes()
    pool = make_pool(vmm, "post-capture")
    assert abs(before - free_bytes()) <= 2 * MIB  # 400k tokens x 32 layers = 52 GB of VA, no memory
    pool.ensure_prefix()
    buffers = 64
    prefix = free_bytes()
    assert before - prefix <= buffers * vmm.granularity_bytes + 2 * MIB
    tokens = pool.finalize_backing(100_000)
    expected = pool.committed_bytes - buffers * vmm.granularity_bytes
    dropped = prefix - free_bytes()
    assert abs(dropped - expected) <= buffers * vmm.granularity_bytes
    exact = buffers * (100_000 + 1) * 8 * 128 * 2  # every buffer: usable tokens + the dummy slot
    assert 0 <= pool.committed_bytes - exact < buffers * vmm.granularity_bytes
    assert tokens == 100_000
    pool.close()
    pool.arena.close()


@pytest.mark.parametrize(("layout", "page_size"), [("nhd", 1), ("hnd", 16)])
def test_graph_captured_on_the_dummy_page_writes_a_high_slot_after_finalize(vmm, layout, page_size):
    pool = make_pool(vmm, "post-capture", layout, page_size)
    pool.ensure_prefix()
    loc = torch.zeros(1, dtype=torch.int64, device="cuda")
    k = torch.randn(1, 8, 128, device="cuda", dtype=torch.bfloat16)
    pool.set_kv(5, loc, k, k)  # warm-up touches the dummy slot only
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        pool.set_kv(5, loc, k * 2, k * 3)
    torch.cuda.synchronize()
    tokens = pool.finalize_backing(300_000)
    high = tokens + page_size - 1
    loc.fill_(high)
    graph.replay()
    torch.cuda.synchronize()
    key, value = pool.get_kv_buffer(5)
    stored_k = key[high] if layout == "nhd" else key[high // page_size, :, high % page_size]
    stored_v = value[high] if layout == "nhd" else value[high // page_size, :, high % page_size]
    assert torch.equal(stored_k, (k * 2)[0]) and torch.equal(stored_v, (k * 3)[0])
    del key, value, stored_k, stored_v, graph
    pool.close()
    pool.arena.close()


def test_commit_beyond_the_gpu_rolls_back_and_the_arena_stays_usable(vmm):
    arena = KvArena(vmm, 512 * GIB, label="oom-test")
    pool = MHAKVPool(
        KVPoolSpec.of(dtype="bfloat16", page_size=1, layout="nhd", device="cuda", mode="post-capture"),
        reserved_tokens=100_000_000,
        num_layers=1,
        num_kv_heads=8,
        head_dim=128,
        arena=arena,
    )
    pool.ensure_prefix()
    before = free_bytes()
    with pytest.raises(CommitError, match="cuMemCreate"):
        pool.finalize_backing(90_000_000)  # ~370 GB: more than any single GPU has
    assert abs(free_bytes() - before) <= 2 * MIB
    assert pool.finalize_backing(100_000) == 100_000
    k = torch.ones(1, 8, 128, device="cuda", dtype=torch.bfloat16)
    pool.set_kv(0, torch.tensor([100_000], device="cuda"), k, k)
    assert pool.get_kv_buffer(0)[0][100_000].float().sum().item() == 8 * 128
    pool.close()
    pool.arena.close()


def test_closing_the_pool_returns_all_memory(vmm):
    before = free_bytes()
    pool = make_pool(vmm, "static")
    assert before - free_bytes() > 40 * GIB
    pool.close()
    pool.arena.close()
    gc.collect()
    assert abs(before - free_bytes()) <= 4 * MIB


def test_fp8_pool_on_gpu_round_trips_e4m3_values(vmm):
    arena = KvArena(vmm, 8 * GIB, label="fp8")
    pool = MHAKVPool(
        KVPoolSpec.of(dtype="fp8_e4m3", page_size=16, layout="hnd", device="cuda", mode="static"),
        reserved_tokens=1024,
        num_layers=1,
        num_kv_heads=2,
        head_dim=4,
        arena=arena,
    )
    values = torch.tensor([[0.5, -1.0, 2.0, 448.0]] * 2, device="cuda").unsqueeze(0)
    pool.set_kv(0, torch.tensor([40], device="cuda"), values, values)
    assert torch.equal(pool.get_kv_buffer(0)[0][2, :, 8].float(), values[0])
    pool.close()
    pool.arena.close()


def test_a_pool_shrink_frees_the_decommitted_bytes_and_keeps_the_rest_bit_for_bit(vmm):
    """Device free memory moves by the committed bytes, which are what `backing_bytes` said: a
    shrink keeps each buffer's extension its end falls in (at most 512 MiB in all more than asked)."""
    pool = make_pool(vmm, "post-capture")
    pool.ensure_prefix()
    pool.finalize_backing(300_000)
    k = torch.randn(100_000, 8, 128, device="cuda", dtype=torch.bfloat16)
    loc = torch.arange(1, 100_001, device="cuda")
    pool.set_kv(7, loc, k, k * 2)
    granule, buffers = vmm.granularity_bytes, 64
    for tokens in (150_001, 100_000, 250_000, 100_000):
        before, committed, expected = free_bytes(), pool.committed_bytes, pool.backing_bytes(tokens)
        pool.finalize_backing(tokens)
        moved = pool.committed_bytes - committed
        assert pool.committed_bytes == expected
        assert abs((before - free_bytes()) - moved) <= buffers * granule, tokens
        assert 0 <= pool.committed_bytes - pool.bytes_for_tokens(tokens) <= SHRINK_EXCESS_BYTES
        key, value = pool.get_kv_buffer(7)
        assert torch.equal(key[1:100_001], k) and torch.equal(value[1:100_001], k * 2)
        del key, value
    pool.close()
    pool.arena.close()


def test_many_small_extensions_map_with_one_access_call_and_hold_what_is_written(vmm):
    """A grow cut into 2 MiB pieces (one cuMemSetAccess over all of them) is readable and writable
    end to end, and gives every byte back."""
    arena = KvArena(vmm, 256 * MIB, label="pieces", chunk_bytes=vmm.granularity_bytes)
    from snugkv.memory.layout import BufferLayout

    buffer = arena.add_buffer(BufferLayout("k", torch.uint8, (), page_size=1), 128 * MIB)
    before = free_bytes()
    arena.commit({"k": 128 * MIB})
    assert len(buffer.extensions) == 128 * MIB // vmm.granularity_bytes
    assert before - free_bytes() >= 128 * MIB
    view = arena.view(buffer)
    pattern = torch.randint(0, 256, (128 * MIB,), dtype=torch.uint8, device="cuda")
    view[: 128 * MIB].copy_(pattern)
    assert torch.equal(view[: 128 * MIB], pattern)
    del view, pattern
    arena.commit({"k": 0})
    assert free_bytes() >= before - 2 * MIB
    gc.collect()
    arena.close()


def test_a_shrink_on_a_full_gpu_frees_memory_without_allocating(vmm):
    """With every other byte of the GPU taken, a shrink still gives memory back (no extension is
    split, so nothing new is created)."""
    pool = make_pool(vmm, "post-capture")
    pool.ensure_prefix()
    pool.finalize_backing(300_000)
    torch.cuda.empty_cache()
    free = free_bytes()
    hog = torch.empty(max(free - 16 * MIB, 0), dtype=torch.uint8, device="cuda")
    try:
        committed = pool.committed_bytes
        expected = pool.backing_bytes(100_000)
        pool.finalize_backing(100_000)
        assert pool.committed_bytes == expected < committed
        assert free_bytes() - 16 * MIB >= (committed - expected) * 0.99
    finally:
        del hog
        torch.cuda.empty_cache()
    pool.close()
    pool.arena.close()
