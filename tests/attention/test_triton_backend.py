"""The Triton backend matches the torch oracle through the real pool and forward batch."""

from __future__ import annotations

import pytest
import torch

from snugkv.attention.torch_backend import TorchAttentionBackend
from snugkv.attention.triton_backend import TritonAttentionBackend
from snugkv.core.forward import BatchRow, ForwardBatch
from snugkv.layers.attention import PagedAttention
from snugkv.memory.allocator import make_allocator
from snugkv.memory.kv_pool import KVPoolSpec, MHAKVPool
from snugkv.memory.req_to_token import ReqToTokenPool
from snugkv.memory.swa_pool import SWAKVPool


def run_both(pool, layer: PagedAttention, rows: list[BatchRow], table: ReqToTokenPool, allocator, seed: int):
    """Allocate slots for `rows`, then run both backends on identical inputs (each on its own copy of KV)."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.tensor([r.prefix_len for r in rows])
    seq = torch.tensor([r.seq_len for r in rows])
    req = torch.tensor([r.req_pool_idx for r in rows])
    last_loc = torch.where(prefix > 0, table.req_to_token[req, (prefix - 1).clamp(min=0)].long(), -1)
    slots = allocator.alloc_extend(prefix, seq, last_loc)
    offset = 0
    for row in rows:
        table.write(row.req_pool_idx, row.prefix_len, slots[offset : offset + len(row.token_ids)])
        offset += len(row.token_ids)
    num_tokens = slots.numel()
    q = torch.randn(num_tokens, layer.num_heads, layer.head_dim, generator=gen)
    k = torch.randn(num_tokens, layer.num_kv_heads, layer.head_dim, generator=gen)
    v = torch.randn(num_tokens, layer.num_kv_heads, layer.head_dim, generator=gen)
    outputs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend(num_kv_splits=2)):
        batch = ForwardBatch.build(
            rows, slots, req_to_token=table.req_to_token, kv_pool=pool, attn_backend=backend
        )
        backend.init_forward_metadata(batch)
        outputs.append(backend.forward(q, k, v, layer, batch))
    return outputs


def small_pool(layout: str, page_size: int, requests: int):
    """A one-layer float32 pool of 256 slots (2 KV heads of 32), its allocator, a table of
    `requests` rows and a GQA layer (4 query heads) over it."""
    pool = MHAKVPool(
        KVPoolSpec.of(dtype="float32", page_size=page_size, layout=layout, device="cpu"),
        reserved_tokens=256,
        num_layers=1,
        num_kv_heads=2,
        head_dim=32,
    )
    layer = PagedAttention(0, num_heads=4, num_kv_heads=2, head_dim=32)
    return pool, make_allocator(256, page_size), ReqToTokenPool(requests, 64), layer


@pytest.mark.parametrize(("layout", "page_size"), [("nhd", 1), ("hnd", 4)])
def test_prefill_then_decode_matches_the_torch_backend(layout, page_size):
    pool, allocator, table, layer = small_pool(layout, page_size, 4)
    a, b = table.alloc(), table.alloc()
    prefill = [BatchRow(a, 0, list(range(7))), BatchRow(b, 0, list(range(5)))]
    torch_out, triton_out = run_both(pool, layer, prefill, table, allocator, seed=1)
    torch.testing.assert_close(triton_out, torch_out, rtol=1e-4, atol=1e-4)
    decode = [BatchRow(a, 7, [1]), BatchRow(b, 5, [2])]
    torch_out, triton_out = run_both(pool, layer, decode, table, allocator, seed=2)
    torch.testing.assert_close(triton_out, torch_out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("layout", "page_size"), [("nhd", 1), ("hnd", 4)])
def test_a_mixed_step_runs_its_decode_rows_and_prompt_chunks_as_the_torch_backend(layout, page_size):
    """Decode rows ahead of prompt chunks (one of them continuing a prefix): the decode rows go to
    the decode kernel, the rest to the extend kernel, and together they match the oracle."""
    pool, allocator, table, layer = small_pool(layout, page_size, 6)
    a, b, c, d = (table.alloc() for _ in range(4))
    prefill = [BatchRow(a, 0, list(range(9))), BatchRow(b, 0, list(range(6))), BatchRow(c, 0, list(range(4)))]
    run_both(pool, layer, prefill, table, allocator, seed=5)
    mixed = [
        BatchRow(a, 9, [1]),
        BatchRow(b, 6, [2]),
        BatchRow(c, 4, list(range(5))),  # the next chunk of a prompt
        BatchRow(d, 0, list(range(7))),  # a new prompt
    ]
    batch = ForwardBatch.build(
        mixed,
        torch.zeros(14, dtype=torch.int64),
        req_to_token=table.req_to_token,
        kv_pool=pool,
        attn_backend=TritonAttentionBackend(),
    )
    assert not batch.is_decode and batch.num_decode_rows == 2
    torch_out, triton_out = run_both(pool, layer, mixed, table, allocator, seed=6)
    torch.testing.assert_close(triton_out, torch_out, rtol=1e-4, atol=1e-4)
    # then a verify step: a row per position through the decode kernel, rows of one request side by side
    verify = [
        BatchRow(a, 10, [1, 2, 3], draft_len=2),
        BatchRow(b, 7, [4], draft_len=0),
        BatchRow(d, 7, [5, 6], draft_len=1),
    ]
    torch_out, triton_out = run_both(pool, layer, verify, table, allocator, seed=7)
    torch.testing.assert_close(triton_out, torch_out, rtol=1e-4, atol=1e-4)


def test_sliding_window_layer_reads_through_the_swa_mapping():
    pool = SWAKVPool(
        KVPoolSpec.of(dtype="float32", page_size=1, layout="nhd", device="cpu"),
        reserved_tokens=64,
        num_layers=2,
        swa_layer_ids=[0],
        num_kv_heads=1,
        head_dim=16,
        swa_full_tokens_ratio=1.0,
    )
    pool.full_to_swa[1:65] = torch.randperm(64) + 1  # window slots scattered differently from full slots
    allocator = make_allocator(64, 1)
    table = ReqToTokenPool(2, 32)
    layer = PagedAttention(0, num_heads=2, num_kv_heads=1, head_dim=16, sliding_window=4)
    row = table.alloc()
    torch_out, triton_out = run_both(
        pool, layer, [BatchRow(row, 0, list(range(9)))], table, allocator, seed=3
    )
    torch.testing.assert_close(triton_out, torch_out, rtol=1e-4, atol=1e-4)
    torch_out, triton_out = run_both(pool, layer, [BatchRow(row, 9, [5])], table, allocator, seed=4)
    torch.testing.assert_close(triton_out, torch_out, rtol=1e-4, atol=1e-4)


def test_a_mixed_steps_extend_rows_get_tensors_of_their_own_16_bytes_aligned():
    """After an odd count of decode rows a slice of the row tensors is off a 16-byte boundary, for
    which Triton would compile the extend kernel again while serving: the rows get aligned copies."""
    table = ReqToTokenPool(6, 64)
    rows = [BatchRow(1, 9, [1]), BatchRow(2, 6, [2]), BatchRow(3, 4, [3]), BatchRow(4, 0, [5, 6, 7])]
    pool = MHAKVPool(
        KVPoolSpec.of(dtype="float32", page_size=1, layout="nhd", device="cpu"),
        reserved_tokens=64,
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
    )
    backend = TritonAttentionBackend()
    batch = ForwardBatch.build(
        rows,
        torch.zeros(6, dtype=torch.int64),
        req_to_token=table.req_to_token,
        kv_pool=pool,
        attn_backend=backend,
    )
    backend.init_forward_metadata(batch)
    assert batch.num_decode_rows == 3
    req, prefix, extend, starts = batch.attn_metadata["extend_rows"]
    assert [req.tolist(), prefix.tolist(), extend.tolist(), starts.tolist()] == [[4], [0], [3], [0]]
    assert all(tensor.data_ptr() % 16 == 0 for tensor in (req, prefix, extend, starts))
