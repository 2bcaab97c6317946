"""The torch attention backend against a dense float64 reference over contiguous K/V.

Requests are laid out through the real pool, allocator and request-to-token table, in both
layouts and with pages, so the test pins the slot/page contract as much as the math.
"""

from __future__ import annotations

import pytest
import torch

from snugkv.attention.torch_backend import (
    TorchAttentionBackend,
    TorchAttentionMetadata,
    attend,
    attend_decode,
)
from snugkv.core.forward import BatchRow, ForwardBatch
from snugkv.layers.attention import PagedAttention
from snugkv.memory.allocator import make_allocator
from snugkv.memory.kv_pool import KVPoolSpec, MHAKVPool
from snugkv.memory.req_to_token import ReqToTokenPool

HEAD_DIM = 16


def dense_reference(q, k, v, prefix_len, sliding_window, scaling):
    """q `[e, Hq, D]` for positions prefix_len.., k/v `[s, Hkv, D]` for positions 0..s-1."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scaling
    query_pos = torch.arange(prefix_len, prefix_len + q.shape[0])[:, None]
    key_pos = torch.arange(k.shape[0])[None, :]
    allowed = key_pos <= query_pos
    if sliding_window is not None:
        allowed &= query_pos - key_pos < sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


class Setup:
    def __init__(self, *, page_size, layout, kv_dtype, num_heads, num_kv_heads, sliding_window):
        self.pool = MHAKVPool(
            KVPoolSpec.of(dtype=kv_dtype, page_size=page_size, layout=layout, device="cpu"),
            reserved_tokens=256,
            num_layers=2,
            num_kv_heads=num_kv_heads,
            head_dim=HEAD_DIM,
        )
        self.allocator = make_allocator(256, page_size)
        self.table = ReqToTokenPool(8, 64)
        self.layer = PagedAttention(1, num_heads, num_kv_heads, HEAD_DIM, sliding_window=sliding_window)
        self.backend = TorchAttentionBackend()
        self.gen = torch.Generator().manual_seed(0)
        self.history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def rand(self, *shape):
        return torch.randn(*shape, generator=self.gen)

    def step(self, rows_spec, *, decode_width=None, drop_cpu_mirrors=False):
        """rows_spec: (req_pool_idx, new_len). Runs the backend and checks it against the reference."""
        rows = []
        for req, new_len in rows_spec:
            cached = self.history.get(req, (torch.empty(0, self.layer.num_kv_heads, HEAD_DIM),) * 2)[0].shape[
                0
            ]
            rows.append(BatchRow(req, cached, [0] * new_len))
        prefix = torch.tensor([r.prefix_len for r in rows])
        seq = torch.tensor([r.seq_len for r in rows])
        last = torch.tensor(
            [
                int(self.table.req_to_token[r.req_pool_idx, r.prefix_len - 1]) if r.prefix_len else -1
                for r in rows
            ]
        )
        slots = self.allocator.alloc_extend(prefix, seq, last)
        start = 0
        for row in rows:
            n = len(row.token_ids)
            self.table.write(row.req_pool_idx, row.prefix_len, slots[start : start + n])
            start += n
        fb = ForwardBatch.build(
            rows, slots, req_to_token=self.table.req_to_token, kv_pool=self.pool, attn_backend=self.backend
        )
        if decode_width is not None:
            fb.kv_width = decode_width
        if drop_cpu_mirrors:
            fb.seq_lens_cpu = fb.prefix_lens_cpu = fb.extend_lens_cpu = None
        total = slots.numel()
        layer = self.layer
        q = self.rand(total, layer.num_heads, HEAD_DIM)
        k, v = self.rand(total, layer.num_kv_heads, HEAD_DIM), self.rand(total, layer.num_kv_heads, HEAD_DIM)
        out = self.backend.forward(q, k, v, layer, fb)
        assert out.shape == (total, layer.num_heads, HEAD_DIM) and out.dtype == q.dtype
        start = 0
        for row in rows:
            n = len(row.token_ids)
            stored_k, stored_v = (t[start : start + n].to(self.pool.dtype).float() for t in (k, v))
            old_k, old_v = self.history.get(row.req_pool_idx, (stored_k[:0], stored_v[:0]))
            full_k, full_v = torch.cat([old_k, stored_k]), torch.cat([old_v, stored_v])
            self.history[row.req_pool_idx] = (full_k, full_v)
            want = dense_reference(
                q[start : start + n], full_k, full_v, row.prefix_len, layer.sliding_window, layer.scaling
            )
            torch.testing.assert_close(out[start : start + n].double(), want, rtol=1e-5, atol=1e-5)
            start += n
        return fb


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (2, 2), (6, 1)])
def test_extend_and_decode_match_dense_attention(layout, page_size, sliding_window, num_heads, num_kv_heads):
    setup = Setup(
        page_size=page_size,
        layout=layout,
        kv_dtype=torch.float32,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        sliding_window=sliding_window,
    )
    setup.table.alloc(), setup.table.alloc(), setup.table.alloc()
    setup.step([(1, 9), (2, 3)])  # two prefills
    fb = setup.step([(1, 1), (2, 6), (3, 7)])  # decode + extend over a prefix + prefill
    assert not fb.is_decode
    fb = setup.step([(1, 1), (2, 1), (3, 1)])
    assert fb.is_decode
    setup.step([(3, 1), (1, 1)], decode_width=64, drop_cpu_mirrors=True)  # the graph-safe form


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_low_precision_cache_is_upcast_on_read(kv_dtype, layout):
    setup = Setup(
        page_size=4, layout=layout, kv_dtype=kv_dtype, num_heads=4, num_kv_heads=2, sliding_window=None
    )
    setup.table.alloc()
    setup.step([(1, 10)])
    setup.step([(1, 1)])


def test_decode_ignores_stale_table_entries_past_the_sequence():
    setup = Setup(
        page_size=1, layout="nhd", kv_dtype=torch.float32, num_heads=2, num_kv_heads=2, sliding_window=None
    )
    setup.table.alloc()
    setup.step([(1, 4)])
    setup.table.req_to_token[1, 5:] = 10**6  # garbage a finished request could have left behind
    setup.step([(1, 1)], decode_width=64)


def test_padded_decode_row_reads_only_the_dummy_slot():
    setup = Setup(
        page_size=4, layout="hnd", kv_dtype=torch.float32, num_heads=2, num_kv_heads=2, sliding_window=None
    )
    layer, pool = setup.layer, setup.pool
    fb = ForwardBatch.build(
        [BatchRow(0, 0, [0])],
        torch.tensor([0]),
        req_to_token=setup.table.req_to_token,
        kv_pool=pool,
        attn_backend=setup.backend,
    )
    v = setup.rand(1, 2, HEAD_DIM)
    out = setup.backend.forward(setup.rand(1, 2, HEAD_DIM), setup.rand(1, 2, HEAD_DIM), v, layer, fb)
    torch.testing.assert_close(out, v)  # one visible key: the output is its value
    k_buffer, _ = pool.get_kv_buffer(layer.layer_id)
    assert k_buffer[1:].abs().sum() == 0, "padding wrote outside the dummy page"


@pytest.mark.parametrize(
    ("batch", "num_heads", "num_kv_heads", "width"), [(1, 9, 3, 70), (3, 4, 2, 17), (2, 6, 1, 1)]
)
def test_decode_attention_is_the_general_attention_bit_for_bit(batch, num_heads, num_kv_heads, width):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(batch, width, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(batch, width, num_kv_heads, HEAD_DIM, generator=gen)
    hidden = torch.rand(batch, width, generator=gen) < 0.3
    hidden[:, 0] = False
    for mask in (hidden, torch.zeros_like(hidden)):
        want = attend(q[:, None], k, v, mask[:, None], 0.3)[:, 0]
        assert torch.equal(attend_decode(q, k, v, mask, 0.3), want)
    assert torch.equal(
        attend_decode(q, k, v, None, 0.3),
        attend(q[:, None], k, v, torch.zeros_like(hidden)[:, None], 0.3)[:, 0],
    )


def test_every_layer_of_a_forward_reads_the_keys_worked_out_once():
    setup = Setup(
        page_size=1, layout="nhd", kv_dtype=torch.float32, num_heads=4, num_kv_heads=2, sliding_window=None
    )
    setup.table.alloc(), setup.table.alloc()
    setup.step([(1, 5), (2, 3)])
    fb = setup.step([(1, 1), (2, 1)])  # rows of 6 and 4 keys: the shorter one's tail is masked
    metadata = fb.attn_metadata
    assert isinstance(metadata, TorchAttentionMetadata) and metadata.decode is not None
    keys = metadata.decode
    other = PagedAttention(0, 4, 2, HEAD_DIM, sliding_window=3)
    q = setup.rand(2, 4, HEAD_DIM)
    setup.backend.forward(q, None, None, other, fb, save_kv=False)
    assert fb.attn_metadata is metadata  # the second layer did not start again
    assert set(keys.hidden) == {None, 3}  # one mask per sliding window, each made once
    assert not keys.sees_all


def test_an_eager_decode_of_rows_of_one_length_needs_no_mask():
    setup = Setup(
        page_size=1, layout="nhd", kv_dtype=torch.float32, num_heads=2, num_kv_heads=1, sliding_window=None
    )
    setup.table.alloc(), setup.table.alloc()
    setup.step([(1, 4), (2, 4)])
    fb = setup.step([(1, 1), (2, 1)])
    keys = fb.attn_metadata.decode
    assert keys.sees_all and keys.hidden == {None: None}
    assert keys.hidden_for(5) is None and keys.hidden_for(4) is not None  # a window under 5 keys hides some
    fb = setup.step([(1, 1), (2, 1)], decode_width=64)  # a graph's static width: masked whatever the lengths
    assert not fb.attn_metadata.decode.sees_all
