"""Decode CUDA graphs: replay equals eager, padding stays in the dummy slot, capture works with
only the dummy page backed (post-capture pool). The GPU tests run on the device only."""

from __future__ import annotations

import pytest
import torch

from snugkv.attention.triton_decode import decode_splits
from snugkv.core.forward import BatchRow
from snugkv.layers.dense_gemm_choice import rows_bucket
from snugkv.runner.cuda_graph import compile_pass_sizes, default_cuda_graph_batch_sizes
from tests.runner.tiny_runner import tiny_runner

GRAPH_SIZES = (1, 2, 4, 8)


def test_default_batch_sizes_are_small_powers_then_multiples_of_eight():
    assert default_cuda_graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert default_cuda_graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert default_cuda_graph_batch_sizes(1) == [1]


def test_the_compile_pass_reaches_every_batch_specialization_of_the_sizes():
    """Whatever the graphs' sizes, the pass's sizes take every split count (the decode attention
    kernels take no batch size argument), rows bucket and integer specialization (1, a multiple of
    16, neither: the kernels that take the batch size as an argument) that any size takes."""
    features = {
        "splits": lambda size: tuple(decode_splits(size, heads) for heads in (1, 2, 4, 8, 16)),
        "rows bucket": lambda size: rows_bucket(size) if size <= 4 else None,
        "triton int": lambda size: "one" if size == 1 else "16" if size % 16 == 0 else "other",
    }
    for max_bs in (1, 3, 8, 80, 160, 256):
        sizes = default_cuda_graph_batch_sizes(max_bs)
        chosen = compile_pass_sizes(sizes)
        assert set(chosen) <= set(sizes) and chosen[-1] == max_bs
        for name, feature in features.items():
            assert {feature(size) for size in sizes} == {feature(size) for size in chosen}, (max_bs, name)
    assert compile_pass_sizes([1, 2, 4, 8, 16, 24, 32, 40, 48]) == [1, 2, 4, 8, 16, 32, 48]


def test_graphs_refuse_a_cpu_runner():
    with pytest.raises(ValueError, match="CUDA device"):
        tiny_runner().capture_cuda_graphs([1])


def _prefilled(runner, num_requests):
    rows = [
        BatchRow(runner.req_to_token_pool.alloc(), 0, list(range(3 + i, 8 + 2 * i)))
        for i in range(num_requests)
    ]
    logits = runner.forward(rows, runner.allocate_slots(rows))
    tokens = logits.argmax(-1).tolist()
    return [BatchRow(row.req_pool_idx, row.seq_len, [token]) for row, token in zip(rows, tokens)]


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("page_size", "layout"), [(1, "nhd"), (16, "hnd")])
def test_graph_replay_equals_eager_decode(backend, dtype, page_size, layout):
    runner = tiny_runner(
        device="cuda",
        dtype=dtype,
        page_size=page_size,
        layout=layout,
        max_requests=12,
        attention_backend=backend,
        pool_mode="post-capture",
        cuda_graph_batch_sizes=GRAPH_SIZES,
    )
    decode_rows = _prefilled(runner, 11)
    for batch_size in (1, 2, 3, 4, 7, 8, 11):
        rows = decode_rows[:batch_size]
        slots = runner.allocate_slots(rows)
        with torch.inference_mode():
            batch = runner.build_batch(rows, slots)
            batch.kv_width = runner.max_context_len  # the graphs' static gather width
            eager = runner.forward_eager(batch).clone()
            used_graph = runner.cuda_graphs.can_run(batch)
            replayed = runner.forward_batch(batch).clone()
        assert used_graph == (batch_size <= max(GRAPH_SIZES))
        if batch_size in GRAPH_SIZES or not used_graph:
            assert torch.equal(replayed, eager), f"batch {batch_size}: graph and eager differ"
        else:  # a padded graph runs different GEMM shapes than the eager batch
            torch.testing.assert_close(replayed, eager, rtol=2e-2, atol=2e-2)
        tokens = replayed.argmax(-1).tolist()
        decode_rows[:batch_size] = [BatchRow(r.req_pool_idx, r.seq_len, [t]) for r, t in zip(rows, tokens)]


@pytest.mark.cuda
def test_padded_rows_write_only_the_dummy_slot():
    runner = tiny_runner(device="cuda", page_size=4, layout="hnd", cuda_graph_batch_sizes=(8,))
    rows = _prefilled(runner, 3)
    slots = runner.allocate_slots(rows)
    k_before, _ = runner.kv_pool.get_kv_buffer(0)
    snapshot = k_before.clone()
    runner.forward(rows, slots)
    k_after, _ = runner.kv_pool.get_kv_buffer(0)
    changed_pages = torch.nonzero((k_after != snapshot).flatten(1).any(dim=1)).flatten().tolist()
    expected_pages = sorted({0, *(int(s) // 4 for s in slots.tolist())})
    assert set(changed_pages) <= set(expected_pages)
    assert set(changed_pages) >= {int(s) // 4 for s in slots.tolist()}


@pytest.mark.cuda
def test_the_graphs_logits_share_the_pool_instead_of_a_buffer_each():
    """Each graph's logits are a borrowed view: the next capture reuses that memory, so the pool
    holds about the largest graph's logits, not the sum over every batch size."""
    from snugkv.runner.cuda_graph import DecodeCudaGraphs

    vocab, sizes = 100_000, list(range(8, 65, 8))

    def forward(batch):
        return torch.full((batch.input_ids.shape[0], vocab), float(batch.input_ids.shape[0]), device="cuda")

    graphs = DecodeCudaGraphs(
        forward,
        req_to_token=torch.zeros(4, 16, dtype=torch.int32, device="cuda"),
        kv_pool=None,
        attn_backend=None,
        batch_sizes=sizes,
    )
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    graphs.capture()
    torch.cuda.empty_cache()
    grown = torch.cuda.memory_reserved() - before
    every_buffer = sum(sizes) * vocab * 4  # 4.5x the largest graph's logits
    assert grown < every_buffer / 2, f"the pool grew {grown / 2**20:.0f} MiB"
    graphs.graphs[64].replay()
    assert float(graphs.outputs[64][63, -1]) == 64.0
