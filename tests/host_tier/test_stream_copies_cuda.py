"""The GPU path of the host tier (run on the device: scripts/gpu_check.sh): pages written to pinned
host memory on the copy stream and loaded back into other device pages arrive bit for bit, through
either copy path, and the compute stream's next work sees the loaded pages without a host wait; the
batched path allocates no device memory while it copies, and beats one copy per run on a
fragmented prefix of the 8B shape."""

from __future__ import annotations

import pytest
import torch

from snugkv.memory.host_tier import HostKvTier, StreamCopies
from snugkv.memory.kv_pool import KVPoolSpec, MHAKVPool
from snugkv.memory.tier_copies import INDEX_ALIGN_BYTES

pytestmark = pytest.mark.cuda


def random_pool(layout: str, tokens: int, layers: int) -> tuple[MHAKVPool, list[torch.Tensor]]:
    """A bfloat16 pool of 16-token pages on the GPU, every byte random, and its page views."""
    device = torch.device("cuda")
    spec = KVPoolSpec.of(dtype="bfloat16", page_size=16, layout=layout, device=device, mode="static")
    pool = MHAKVPool(spec, reserved_tokens=tokens, num_layers=layers, num_kv_heads=8, head_dim=128)
    views = pool.page_views()
    for view in views:
        view.copy_(torch.randint(0, 255, view.shape, dtype=torch.uint8, device=device))
    return pool, views


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_pages_round_trip_through_pinned_memory_on_the_copy_stream(layout):
    device = torch.device("cuda")
    pool, views = random_pool(layout, 1024, 4)
    tier = HostKvTier(views, num_pages=32, page_size=16, copies=StreamCopies(device), pin_memory=True)
    source = torch.tensor([3, 4, 5, 9, 12, 13])
    host = tier.alloc(source.numel())
    assert host is not None
    expected = [view[source.to(device)].clone() for view in views]
    tier.write(source, host).wait()
    target = torch.tensor([40, 41, 42, 50, 51, 60])
    tier.load(host, target)  # the compute stream's next work waits for it; the host does not
    loaded = [view[target.to(device)] for view in views]
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(loaded, expected))
    traffic = tier.traffic()
    assert traffic.bytes_to_device == traffic.bytes_to_host == 6 * tier.page_bytes
    tier.close()
    del views  # the pool's arena refuses to close under live views of it
    pool.close()


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_batched_copies_round_trip_through_a_small_staging_and_allocate_no_device_memory(layout):
    device = torch.device("cuda")
    pool, views = random_pool(layout, 1024, 4)
    page_bytes = sum(view.shape[1] for view in views)
    staging = torch.empty(INDEX_ALIGN_BYTES + 4 * (page_bytes + 8), dtype=torch.uint8, device=device)
    tier = HostKvTier(
        views, num_pages=32, page_size=16, copies=StreamCopies(device), pin_memory=True, staging=staging
    )
    assert tier.path.name == "batched" and tier.path.word_bytes == 8 and tier.path.lanes == 2
    # two lanes of two pages: five chunks, each lane's scatter beside the other's host copy
    source = torch.tensor([3, 4, 5, 9, 12, 13, 30, 2, 40, 41])
    host = tier.alloc(source.numel())
    assert host is not None
    expected = [view[source.to(device)].clone() for view in views]
    torch.cuda.synchronize()
    target = torch.tensor([50, 51, 52, 53, 20, 21, 60, 61, 62, 7])

    def allocations() -> int:
        return int(torch.cuda.memory_stats(device)["allocation.all.allocated"])

    before = allocations()
    tier.write(source, host).wait()
    written = allocations()
    tier.load(host, target)  # the compute stream's next work waits for it; the host does not
    loaded_at = allocations()
    # the copies allocated nothing on the device, either way (counted before the checks' gathers)
    assert (written - before, loaded_at - written) == (0, 0)
    loaded = [view[target.to(device)] for view in views]
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(loaded, expected))
    tier.close()
    del views, staging  # the pool's arena refuses to close under live views of it
    pool.close()


def test_the_batched_path_loads_a_fragmented_8b_prefix_faster_than_one_copy_per_run():
    from snugkv.bench.host_tier_copies import copy_micro_bench
    from snugkv.bench.model_configs import benchmark_model

    result = copy_micro_bench(
        benchmark_model("llama-3-8b"), tokens=4000, page_size=16, device=torch.device("cuda")
    )
    assert result["per_run_pages_match"] and result["batched_pages_match"]
    assert result["batched_copies_per_load"] * 10 < result["per_run_copies_per_load"]
    assert result["batched_load_gb_per_s"] > result["per_run_load_gb_per_s"], result
    assert result["batched_write_gb_per_s"] > result["per_run_write_gb_per_s"], result


def test_many_chunks_written_and_loaded_back_to_back_through_two_lanes_arrive_bit_for_bit():
    """Writes and loads of many chunks queued one after another with no host wait between them:
    a lane's staging or index reused before its last reader (on either stream) ended would show as
    wrong bytes."""
    device = torch.device("cuda")
    pool, views = random_pool("nhd", 16 * 400, 8)
    page_bytes = sum(view.shape[1] for view in views)
    staging = torch.empty(INDEX_ALIGN_BYTES + 6 * (page_bytes + 8), dtype=torch.uint8, device=device)
    tier = HostKvTier(
        views, num_pages=300, page_size=16, copies=StreamCopies(device), pin_memory=True, staging=staging
    )
    assert tier.path.lanes == 2 and tier.path.chunk_pages == 3
    generator = torch.Generator().manual_seed(11)
    order = torch.randperm(199, generator=generator) + 1
    sources = [order[:60], order[60:120], order[120:180]]  # 20 chunks each, scattered pages
    expected = [[view[pages.to(device)].clone() for view in views] for pages in sources]
    hosts = [tier.alloc(60) for _ in sources]
    assert all(host is not None for host in hosts)
    targets = [torch.arange(200, 260), torch.arange(260, 320), torch.arange(320, 380)]
    for pages, host in zip(sources, hosts):  # queued, nobody waits
        tier.write(pages, host)
    for host, pages in zip(hosts, targets):
        tier.load(host, pages)
    tier.write(targets[0], hosts[1])  # a write after loads, then its load back over the first target
    tier.load(hosts[1], targets[2])
    torch.cuda.synchronize()
    for pages, want in zip((targets[0], targets[1], targets[2]), (expected[0], expected[1], expected[0])):
        got = [view[pages.to(device)] for view in views]
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    tier.close()
    del views, staging
    pool.close()


def test_pinned_host_bytes_are_exactly_the_size_asked_and_copy_asynchronously():
    """Not a power of two (torch's pinned allocator would have rounded 3 GiB + 2 MiB up to 4 GiB)."""
    import time

    from snugkv.memory.pinned import HostBytes

    size = 3 * 2**30 + 2 * 2**20
    started = time.perf_counter()
    pinned = HostBytes(size)
    took = time.perf_counter() - started
    assert pinned.pinned and pinned.tensor.numel() == size and pinned.tensor.is_pinned()
    device = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
    pinned.tensor.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(pinned.tensor[-4096:].cuda(), device[-4096:])
    print(f"pinned {size / 2**30:.3f} GiB in {took:.2f} s ({size / took / 1e9:.1f} GB/s)")
    pinned.close()
    assert not pinned.pinned and pinned.tensor.numel() == 0


def test_pages_written_out_go_back_without_a_host_wait_and_the_device_reuses_them_after_the_write():
    """An eviction's write while a step is in flight (here a kernel that sleeps ~0.5 s): the slots
    are handed back at once, and a kernel that overwrites them runs after the write, so the host
    copy holds the old bytes."""
    import time

    device = torch.device("cuda")
    pool, views = random_pool("hnd", 1024, 4)
    tier = HostKvTier(views, num_pages=32, page_size=16, copies=StreamCopies(device), pin_memory=True)
    loaded_host = tier.alloc(2)
    evicted_host = tier.alloc(3)
    assert loaded_host is not None and evicted_host is not None
    tier.write(torch.tensor([1, 2]), loaded_host).wait()
    evicted = torch.tensor([10, 11, 12])
    expected = [view[evicted.to(device)].clone() for view in views]
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # the step in flight (about half a second on an H100)
    tier.load(loaded_host, torch.tensor([20, 21]))
    started = time.perf_counter()
    tier.write(evicted, evicted_host).before_device_reuse()
    handed_back_s = time.perf_counter() - started
    for view in views:  # the next step writes new KV into the slots just handed back
        view[evicted.to(device)] = 0
    torch.cuda.synchronize()
    waited_s = time.perf_counter() - started
    assert handed_back_s < 0.05 < waited_s, (handed_back_s, waited_s)
    target = torch.tensor([30, 31, 29])
    tier.load(evicted_host, target)
    torch.cuda.synchronize()
    assert all(torch.equal(view[target.to(device)], old) for view, old in zip(views, expected))
    tier.close()
    del views, view  # the loop's last view too: the arena refuses to close under a live view
    pool.close()


def test_a_load_runs_beside_the_step_in_flight_and_the_next_step_reads_what_it_loaded():
    """Free pages are used by no queued work (the scheduler holds back the slots of requests in an
    unread step), so a load need not wait for the step in flight (~0.5 s of sleep here)."""
    device = torch.device("cuda")
    pool, views = random_pool("nhd", 1024, 4)
    tier = HostKvTier(views, num_pages=32, page_size=16, copies=StreamCopies(device), pin_memory=True)
    host = tier.alloc(4)
    assert host is not None
    source = torch.tensor([1, 2, 3, 4])
    tier.write(source, host).wait()
    expected = [view[source.to(device)].clone() for view in views]
    torch.cuda.synchronize()
    in_flight = torch.cuda.Event()
    torch.cuda._sleep(1_000_000_000)
    in_flight.record()
    target = torch.tensor([40, 41, 42, 43])
    done = tier.load(host, target)
    done.wait()  # on the copy stream alone: it does not wait for the sleeping step
    assert not in_flight.query(), "the load waited for the step in flight"
    loaded = [view[target.to(device)].clone() for view in views]  # the next step, after the load
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(loaded, expected))
    tier.close()
    del views, loaded
    pool.close()
