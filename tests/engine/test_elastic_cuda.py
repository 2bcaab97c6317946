"""Elastic memory on a real GPU (run on the device by scripts/gpu_check.sh; skipped on CPU): free
device memory moves by the resized bytes, and captured decode graphs replay exactly what eager runs
after a shrink that moved live KV, after a grow and after sleep and wake."""

from __future__ import annotations

import pytest
import torch

from snugkv.core.forward import BatchRow
from snugkv.engine import Engine, EngineArgs
from snugkv.memory.vmm import MIB
from tests.runner.tiny_runner import tiny_config_path

pytestmark = pytest.mark.cuda

GRAPH_BATCH = 8


def free_bytes() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def start(**overrides) -> Engine:
    args = dict(
        model=str(tiny_config_path()),
        load_format="dummy",
        device="cuda",
        dtype="float32",
        page_size=16,
        max_running_requests=2 * GRAPH_BATCH,  # table rows for the filler requests too
        cuda_graph_max_bs=GRAPH_BATCH,
        context_length=128,
        kv_chunk_mib=64,
    )
    return Engine(EngineArgs.of(**{**args, **overrides}))


def test_free_device_memory_moves_by_the_resized_bytes():
    engine = start(max_total_tokens=16_000_000)  # 256 B a token: about 4 GiB
    pool = engine.pool
    slack = len(pool.arena.buffers) * engine.memory.granularity_bytes  # one granule per buffer
    # a shrink drops whole chunks and keeps the one the end falls in (arena.py): one per buffer
    kept_by_a_shrink = len(pool.arena.buffers) * pool.arena.chunk_bytes
    for tokens in (4_000_000, 12_000_000, 1_000_000, 16_000_000):
        before, committed = free_bytes(), pool.committed_bytes
        engine.resize_kv(tokens)
        assert abs((before - free_bytes()) - (pool.committed_bytes - committed)) <= slack, tokens
        over = pool.committed_bytes - pool.bytes_for_tokens(tokens)
        assert 0 <= over < (kept_by_a_shrink if pool.committed_bytes < committed else slack), (tokens, over)
    weights = engine.loaded.weights
    assert weights is not None
    before, held = free_bytes(), pool.committed_bytes + weights.committed_bytes
    engine.sleep(level=1)
    assert abs((free_bytes() - before) - held) <= slack + 2 * MIB
    engine.wake_up()
    assert abs(before - free_bytes()) <= 64 * MIB  # sized again from free memory: about the same
    engine.close()


def _decode_rows(engine: Engine, count: int, filler: int) -> list[BatchRow]:
    """`count` prefilled requests whose pages sit above `filler` freed requests' pages."""
    runner = engine.runner
    fill = [BatchRow(runner.req_to_token_pool.alloc(), 0, list(range(3, 60))) for _ in range(filler)]
    fill_slots = runner.allocate_slots(fill)
    rows = [
        BatchRow(runner.req_to_token_pool.alloc(), 0, list(range(5 + i, 40 + 3 * i))) for i in range(count)
    ]
    tokens = runner.forward(rows, runner.allocate_slots(rows)).argmax(-1).tolist()
    runner.allocator.free(fill_slots)
    for row in fill:
        runner.req_to_token_pool.free(row.req_pool_idx)
    return [BatchRow(row.req_pool_idx, row.seq_len, [token]) for row, token in zip(rows, tokens)]


def _graph_and_eager(engine: Engine, rows: list[BatchRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one decode step, replayed from the graph and run eagerly over the same slots (a
    second call for the same rows continues the same partial pages: the same slots again)."""
    runner = engine.runner
    slots = runner.allocate_slots(rows)
    with torch.inference_mode():
        batch = runner.build_batch(rows, slots)
        batch.kv_width = runner.max_context_len  # the graphs' static gather width
        eager = runner.forward_eager(batch).clone()
        assert runner.cuda_graphs is not None and runner.cuda_graphs.can_run(batch)
        replayed = runner.forward_batch(batch).clone()
    return replayed, eager


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_graph_replay_equals_eager_after_shrink_grow_and_wake(layout):
    engine = start(max_total_tokens=8192, kv_layout=layout)
    runner = engine.runner
    rows = _decode_rows(engine, GRAPH_BATCH, filler=6)
    replayed, eager = _graph_and_eager(engine, rows)
    assert torch.equal(replayed, eager)
    before = eager
    table = runner.req_to_token_pool.req_to_token
    highest = int(table[[row.req_pool_idx for row in rows]].max())
    in_use = runner.allocator.capacity_tokens - runner.allocator.available_tokens
    target = -(-(in_use + 16 * GRAPH_BATCH) // 16) * 16
    assert target < highest  # the live pages must move
    shrunk = engine.resize_kv(target)
    assert shrunk.moved_pages > 0
    for change in ("shrink", "grow"):
        if change == "grow":
            engine.resize_kv(8192)
        replayed, eager = _graph_and_eager(engine, rows)
        assert torch.equal(replayed, eager), change
        assert torch.equal(replayed, before), change  # the same KV, read at its new place
    engine.close()


@pytest.mark.parametrize(("level", "tags"), [(1, ()), (2, ()), (1, ("weights", "kv_cache", "cuda_graph"))])
def test_graph_replay_equals_eager_after_sleep_and_wake(level, tags):
    engine = start(max_total_tokens=8192, prefill_graph_max_tokens=64)
    runner = engine.runner
    rows = _decode_rows(engine, GRAPH_BATCH, filler=0)
    _, before = _graph_and_eager(engine, rows)
    addresses = [p.data_ptr() for p in engine.loaded.model.parameters()]
    for row in rows:  # sleep needs every slot free: the requests start again after the wake
        runner.allocator.free(runner.req_to_token_pool.req_to_token[row.req_pool_idx, : row.seq_len])
        runner.req_to_token_pool.free(row.req_pool_idx)
    graphs = runner.cuda_graphs, runner.piecewise_graphs
    engine.sleep(level=level, tags=tags)
    assert (runner.cuda_graphs is None) == ("cuda_graph" in tags)
    engine.wake_up()
    assert [p.data_ptr() for p in engine.loaded.model.parameters()] == addresses
    assert runner.piecewise_graphs is not None
    recaptured = (runner.cuda_graphs, runner.piecewise_graphs) != graphs
    assert recaptured == ("cuda_graph" in tags)
    rows = _decode_rows(engine, GRAPH_BATCH, filler=0)
    replayed, eager = _graph_and_eager(engine, rows)
    assert torch.equal(replayed, eager)
    assert torch.equal(eager, before)  # the same weights (copied back, or the same seed again)
    engine.close()


def test_max_device_memory_lets_the_engine_use_the_room_it_gives():
    """Under a cap the engine holds the cap less its activation headroom (the KV cache takes the
    rest). At 442a8fd it left ~350 MiB more unused: it counted torch's reserved memory of the whole
    process, blocks earlier tests left behind included, as its own."""
    from snugkv.memory.vmm import GIB

    cap = 3 * GIB
    leftover = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")  # another tensor of the process
    engine = start(max_device_memory_gib=3.0)
    held = engine.baseline_free_bytes - free_bytes()
    breakdown = (
        f"held {held / MIB:.0f} MiB by the device; KV {engine.pool.committed_bytes / MIB:.0f}, "
        f"torch reserved {torch.cuda.memory_reserved() / MIB:.0f} (baseline "
        f"{engine.baseline_reserved_bytes / MIB:.0f}), headroom {engine.headroom_bytes / MIB:.0f} MiB"
    )
    engine.close()
    del leftover
    assert cap - engine.headroom_bytes - 256 * MIB <= held <= cap + 256 * MIB, breakdown


def test_max_device_memory_holds_at_start_up_on_resize_and_on_wake():
    from snugkv.memory.vmm import GIB
    from snugkv.sizing.resize import KvResizeError

    cap = 3 * GIB
    engine = start(max_device_memory_gib=3.0)

    def held() -> int:  # everything the engine took since its baseline (other processes aside)
        return engine.baseline_free_bytes - free_bytes()

    assert held() <= cap + 256 * MIB  # kernel modules loaded outside torch's allocator are the slack
    limit = engine.kv.limits().cap_tokens
    with pytest.raises(KvResizeError, match="--max-device-memory 3 GiB"):
        engine.resize_kv(limit + 1024)
    engine.resize_kv(limit // 2 // 16 * 16)
    engine.resize_kv(limit)
    assert held() <= cap + 256 * MIB
    engine.sleep(level=1)
    engine.wake_up()
    assert held() <= cap + 256 * MIB
    engine.close()
