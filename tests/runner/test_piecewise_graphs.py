"""Piecewise CUDA graphs (everything but attention, per token-count bucket) compute what the eager
forward computes: prefill with and without cached prefixes, several rows, token counts between
buckets (padding), decode batches beyond the decode graphs; padding writes only the dummy slot."""

from __future__ import annotations

import pytest
import torch

from snugkv.core.forward import BatchRow
from snugkv.runner.piecewise_graphs import default_token_buckets
from tests.runner.tiny_runner import tiny_runner

BUCKETS = (16, 32, 64)


def test_buckets_cover_every_count_up_to_the_largest_with_a_third_of_padding_at_most():
    buckets = default_token_buckets(8192)
    assert buckets[0] == 16 and buckets[-1] == 8192 and buckets == sorted(set(buckets))
    for count in range(256, 8193, 37):
        padded = next(b for b in buckets if b >= count)
        assert padded <= count * 1.5
    assert default_token_buckets(100)[-1] == 100


def test_piecewise_graphs_refuse_a_cpu_runner():
    with pytest.raises(ValueError, match="CUDA device"):
        tiny_runner().capture_piecewise_graphs([16])


def _close(replayed: torch.Tensor, eager: torch.Tensor, dtype: str) -> None:
    if dtype == "float32":  # padded GEMM shapes may pick other cuBLAS kernels: last-bit differences
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(replayed, eager, rtol=3e-2, atol=3e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("page_size", "layout"), [(1, "nhd"), (16, "hnd")])
def test_piecewise_replay_equals_eager_for_prefill_and_large_decode(backend, dtype, page_size, layout):
    def build():
        return tiny_runner(
            device="cuda",
            dtype=dtype,
            page_size=page_size,
            layout=layout,
            max_requests=12,
            attention_backend=backend,
            cuda_graph_batch_sizes=(1, 2),
            piecewise_token_buckets=BUCKETS,
        )

    eager_runner, graph_runner = build(), build()

    def cached(runner, row: int) -> int:
        return int((runner.req_to_token_pool.req_to_token[row] != 0).sum())  # slot 0 is never handed out

    schedule = [
        [(0, list(range(3, 12)))],  # one row, 9 tokens: padded to 16
        [(0, list(range(40, 60))), (1, list(range(5, 30)))],  # two rows, 45 tokens
    ]
    rows_of = {}
    for step in schedule:
        for runner in (eager_runner, graph_runner):
            rows = []
            for index, tokens in step:
                if (id(runner), index) not in rows_of:
                    rows_of[(id(runner), index)] = runner.req_to_token_pool.alloc()
                row = rows_of[(id(runner), index)]
                rows.append(BatchRow(row, cached(runner, row), tokens))
            slots = runner.allocate_slots(rows)
            with torch.inference_mode():
                batch = runner.build_batch(rows, slots)
                if runner is eager_runner:
                    eager = runner.forward_eager(batch).clone()
                else:
                    assert runner.piecewise_graphs is not None and runner.piecewise_graphs.can_run(batch)
                    replayed = runner.forward_batch(batch).clone()
        _close(replayed, eager, dtype)
    # three rows of one token each: a decode batch beyond the decode graphs (1, 2), so piecewise
    for runner in (eager_runner, graph_runner):
        rows = [
            BatchRow(rows_of[(id(runner), i)], cached(runner, rows_of[(id(runner), i)]), [7]) for i in (0, 1)
        ]
        rows.append(BatchRow(runner.req_to_token_pool.alloc(), 0, [5]))
        slots = runner.allocate_slots(rows)
        with torch.inference_mode():
            batch = runner.build_batch(rows, slots)
            if runner is eager_runner:
                eager = runner.forward_eager(batch).clone()
            else:
                replayed = runner.forward_batch(batch).clone()
    _close(replayed, eager, dtype)


@pytest.mark.cuda
def test_padding_tokens_write_only_the_dummy_slot():
    runner = tiny_runner(device="cuda", page_size=4, layout="hnd", piecewise_token_buckets=(32,))
    row = runner.req_to_token_pool.alloc()
    rows = [BatchRow(row, 0, list(range(3, 13)))]  # 10 tokens in a bucket of 32
    slots = runner.allocate_slots(rows)
    k_before, _ = runner.kv_pool.get_kv_buffer(1)
    snapshot = k_before.clone()
    runner.forward(rows, slots)
    k_after, _ = runner.kv_pool.get_kv_buffer(1)
    changed_pages = torch.nonzero((k_after != snapshot).flatten(1).any(dim=1)).flatten().tolist()
    assert set(changed_pages) <= {0, *(int(s) // 4 for s in slots.tolist())}
    assert set(changed_pages) >= {int(s) // 4 for s in slots.tolist()}


def test_static_tensors_are_shared_by_role_and_row_shape():
    from snugkv.runner.piecewise_graphs import _StaticTensors

    statics = _StaticTensors(max_tokens=64)
    cpu = torch.device("cpu")
    first = statics.view("out", (64, 4, 8), torch.float32, cpu)
    second = statics.view("out", (16, 4, 8), torch.float32, cpu)  # a later layer or a smaller bucket
    assert second.data_ptr() == first.data_ptr() and second.shape == (16, 4, 8)
    assert statics.view("out", (8, 2, 8), torch.float32, cpu).data_ptr() != first.data_ptr()
    assert statics.view("out", (8, 4, 8), torch.bfloat16, cpu).data_ptr() != first.data_ptr()


@pytest.mark.cuda
def test_every_layer_and_bucket_writes_attention_into_one_static_output():
    runner = tiny_runner(device="cuda", dtype="bfloat16", max_requests=4, piecewise_token_buckets=BUCKETS)
    graphs = runner.piecewise_graphs
    assert graphs is not None
    calls = [call for bucket in graphs.buckets.values() for call in bucket.calls]
    assert len(calls) == len(BUCKETS) * len(graphs.buckets[BUCKETS[0]].calls) > len(BUCKETS)
    assert len({call.out.data_ptr() for call in calls}) == 1


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_a_borrowed_view_reads_the_tensor_without_keeping_its_memory(dtype):
    """The q/k/v of a captured call are borrowed: what the pool may reuse once the call is done."""
    from snugkv.runner.cuda_graph import borrowed_view

    base = torch.randn(4096, 8, 64, device="cuda").to(dtype)
    tensor = base[:, 2:6]  # a strided view, as q/k/v split from one projection are
    borrowed = borrowed_view(tensor)
    assert (borrowed.dtype, borrowed.shape, borrowed.stride()) == (dtype, tensor.shape, tensor.stride())
    assert borrowed.data_ptr() == tensor.data_ptr() and torch.equal(borrowed.float(), tensor.float())
    allocated = torch.cuda.memory_allocated()
    del base, tensor
    assert torch.cuda.memory_allocated() <= allocated - 4096 * 8 * 64 * borrowed.element_size()
