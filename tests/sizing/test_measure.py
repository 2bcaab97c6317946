"""Memory pressure's frequent free-memory check counts torch's unused cached blocks as free, but not
those that emptying the cache cannot hand back (the CUDA graphs' private pools): a KV grow cannot be
backed from them. On CPU with torch.cuda's counters replaced; on the GPU with a real graph pool."""

from __future__ import annotations

import pytest
import torch

from snugkv.sizing import measure

GIB = 2**30


class Counters:
    """torch.cuda's allocator counters as a test sets them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reserved = 0
        self.allocated = 0
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "empty_cache", self._empty)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(measure, "_KEPT_UNUSED_BYTES", {})
        self.unreleasable = 0  # unused bytes empty_cache keeps (a graph pool's free blocks)

    def _empty(self) -> None:
        self.reserved = self.allocated + self.unreleasable


def test_a_graph_pools_free_blocks_do_not_count_as_free_after_a_settle(monkeypatch):
    counters = Counters(monkeypatch)
    cuda = torch.device("cuda", 0)
    counters.allocated, counters.unreleasable = 10 * GIB, 2 * GIB
    counters.reserved = 15 * GIB  # 2 GiB in the graph pool, 3 GiB of cached activations
    assert measure.cached_unused_bytes(cuda) == 5 * GIB  # nothing settled yet: all of it
    measure.settle(cuda)
    assert counters.reserved == 12 * GIB
    assert measure.cached_unused_bytes(cuda) == 0
    counters.reserved = 13 * GIB  # a step's activations, freed: 1 GiB cached again
    assert measure.cached_unused_bytes(cuda) == GIB
    counters.allocated = 10 * GIB + GIB // 2  # a step reused some of the kept fragments
    assert measure.cached_unused_bytes(cuda) == GIB // 2


def test_off_cuda_nothing_is_cached():
    assert measure.cached_unused_bytes(torch.device("cpu")) == 0


@pytest.mark.cuda
def test_on_the_gpu_a_captured_graphs_pool_is_not_counted_but_freed_activations_are():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run scripts/gpu_check.sh on the device)")
    device = torch.device("cuda", torch.cuda.current_device())
    static = torch.zeros(1024, device=device)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        static.add_(1)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph, stream=stream):
        scratch = torch.empty(64 * 2**20, device=device)  # 256 MiB freed inside the graph's pool
        scratch.fill_(1)
        static.add_(scratch[:1024])
        del scratch
    graph.replay()
    measure.settle(device)
    assert measure.cached_unused_bytes(device) < 2**20
    activations = torch.empty(128 * 2**20 // 4, device=device)
    del activations
    unused = measure.cached_unused_bytes(device)
    assert 128 * 2**20 <= unused < 130 * 2**20, unused
    del graph
    measure.settle(device)
