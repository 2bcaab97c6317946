"""KV pools: modes, logs, layouts, and the byte-span guarantee of `finalize_backing`."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from snugkv.memory.arena import KvArena
from snugkv.memory.kv_pool import DraftKvShape, KVPool, KVPoolSpec, MHAKVPool, PoolMode
from snugkv.memory.layout import KVLayout
from snugkv.memory.mla_pool import MLAKVPool
from snugkv.memory.swa_pool import SWAKVPool
from snugkv.memory.vmm import MIB, CommitError
from snugkv.memory.vmm_host import HostVmm

DTYPES = ["float16", "bfloat16", "float32", "fp8_e4m3"]
GRANULE = 64 * 1024


def make_pool(
    kind: str, *, dtype: str, page_size: int, layout: str, reserved_tokens: int, mode: str, arena=None
) -> KVPool:
    spec = KVPoolSpec.of(dtype=dtype, page_size=page_size, layout=layout, device="cpu", mode=mode)
    if arena is None:
        arena = KvArena(HostVmm(granularity_bytes=GRANULE), 4096 * MIB, label="test")
    if kind == "mha":
        return MHAKVPool(
            spec, reserved_tokens=reserved_tokens, num_layers=2, num_kv_heads=3, head_dim=24, arena=arena
        )
    if kind == "mla":
        return MLAKVPool(
            spec,
            reserved_tokens=reserved_tokens,
            num_layers=2,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            arena=arena,
        )
    return SWAKVPool(
        spec,
        reserved_tokens=reserved_tokens,
        num_layers=3,
        swa_layer_ids=[0, 2],
        num_kv_heads=2,
        head_dim=16,
        swa_full_tokens_ratio=0.6,
        arena=arena,
    )


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["mha", "mla", "swa"]),
    layout=st.sampled_from(["nhd", "hnd"]),
    page_size=st.sampled_from([1, 2, 3, 16, 64, 256]),
    dtype=st.sampled_from(DTYPES),
    pages=st.integers(min_value=0, max_value=400),
)
def test_finalize_backs_every_byte_a_valid_slot_touches(kind, layout, page_size, dtype, pages):
    upper_tokens = 400 * page_size
    pool = make_pool(
        kind,
        dtype=dtype,
        page_size=page_size,
        layout=layout,
        reserved_tokens=upper_tokens,
        mode="post-capture",
    )
    pool.ensure_prefix()
    num_tokens = pool.finalize_backing(pages * page_size)
    assert num_tokens == pages * page_size
    for group, tokens in pool.tokens_per_group(num_tokens).items():
        for buffer in pool._buffers[group]:
            layout_ = buffer.layout
            exact = layout_.bytes_for_tokens(tokens)
            # every byte the last valid slot (and the dummy page's first slot) touches is backed
            last_slot = tokens + page_size - 1
            for slot in (0, page_size - 1, last_slot):
                _, end = layout_.slot_byte_range(slot)
                assert end <= buffer.committed_bytes, (buffer.name, slot)
            assert buffer.committed_bytes >= exact
            # at most one granule wasted, nothing beyond N committed
            assert buffer.committed_bytes - exact < GRANULE, buffer.name
    # a real write into the highest valid slot of every layer (faults if not backed)
    slot = torch.tensor([num_tokens + page_size - 1])
    for layer in range(pool.num_layers):
        k, _ = pool.get_kv_buffer(layer)
        slot_shape = (1, *k.shape[1:]) if layout == "nhd" else (1, k.shape[1], k.shape[-1])
        if kind == "mla":
            pool.set_kv(layer, slot, torch.ones(slot_shape))
        elif kind == "swa" and pool.slot_map(layer) is not None:
            continue  # window slots come from the allocator's mapping
        else:
            pool.set_kv(layer, slot, torch.ones(slot_shape), torch.ones(slot_shape))


def test_bytes_for_tokens_matches_what_finalize_commits():
    pool = make_pool(
        "mha", dtype="bfloat16", page_size=16, layout="hnd", reserved_tokens=50_000, mode="post-capture"
    )
    tokens = pool.finalize_backing(12_345)
    assert pool.committed_bytes == pool.bytes_for_tokens(tokens)


def test_max_tokens_within_is_the_largest_count_that_fits():
    pool = make_pool(
        "swa", dtype="float16", page_size=4, layout="nhd", reserved_tokens=100_000, mode="post-capture"
    )
    budget = 5 * MIB
    tokens = pool.max_tokens_within(budget)
    assert tokens % 4 == 0 and tokens > 0
    assert pool.bytes_for_tokens(tokens) <= budget < pool.bytes_for_tokens(tokens + 4)
    assert pool.max_tokens_within(budget, tokens + 100) == tokens  # a cap above what fits changes nothing
    assert pool.max_tokens_within(budget, 1_001) == 1_000  # one below it is the answer, a page multiple
    assert pool.max_tokens_within(10**15, 10**9) == 100_000  # never past the reserve


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["mha", "mla", "swa"]),
    page_size=st.sampled_from([1, 16, 64]),
    sizes=st.lists(st.integers(min_value=0, max_value=60_000), min_size=2, max_size=6),
    budget_share=st.floats(min_value=0.0, max_value=1.2),
)
def test_a_budget_sized_shrink_releases_at_least_what_it_asks_and_never_commits(
    kind, page_size, sizes, budget_share
):
    """After any history of resizes, the count `max_tokens_within` gives for a byte budget leaves
    exactly `backing_bytes` committed, within the budget, and a shrink to it commits nothing new."""
    vmm = HostVmm(granularity_bytes=GRANULE)
    arena = KvArena(vmm, 4096 * MIB, label="test", chunk_bytes=4 * GRANULE)
    pool = make_pool(
        kind,
        dtype="float16",
        page_size=page_size,
        layout="nhd",
        reserved_tokens=60_000,
        mode="post-capture",
        arena=arena,
    )
    pool.ensure_prefix()
    for tokens in sizes:
        pool.finalize_backing(min(tokens, pool.reserved_tokens))  # the reserve is page-aligned
    committed = pool.committed_bytes
    budget = int(committed * budget_share)
    tokens = pool.max_tokens_within(budget)
    if pool.backing_bytes(0) > budget:
        assert tokens == 0
        return
    expected = pool.backing_bytes(tokens)
    assert expected <= budget
    if tokens + page_size <= pool.reserved_tokens:
        assert pool.backing_bytes(tokens + page_size) > budget  # the most that fits
    asked = [] if expected >= committed else None
    real_commit = vmm.commit
    vmm.commit = lambda *a: asked.append(a) or real_commit(*a)  # a shrink must not ask for memory
    pool.finalize_backing(tokens)
    assert pool.committed_bytes == expected
    if asked is None:
        assert vmm.committed_bytes == expected  # backs exactly what was said, and gave the rest back


def test_a_cap_that_fits_is_answered_without_a_search(monkeypatch):
    pool = make_pool(
        "mha", dtype="float16", page_size=4, layout="nhd", reserved_tokens=100_000, mode="post-capture"
    )
    asked = []
    real = pool.backing_bytes
    monkeypatch.setattr(pool, "backing_bytes", lambda tokens: asked.append(tokens) or real(tokens))
    assert pool.max_tokens_within(1 << 40, 1_024) == 1_024
    assert asked == [1_024]


def test_post_capture_pool_costs_nothing_until_the_prefix_is_backed(caplog):
    with caplog.at_level(logging.INFO):
        pool = make_pool(
            "mha", dtype="bfloat16", page_size=1, layout="nhd", reserved_tokens=1_000_000, mode="post-capture"
        )
    assert pool.committed_bytes == 0
    assert "KV Cache VA upper bound. dtype: torch.bfloat16, #tokens: 1000000" in caplog.text
    pool.ensure_prefix()
    assert pool.committed_bytes == 2 * GRANULE  # one granule per buffer: 2 layers, K and V in one


def test_static_pool_is_fully_backed_at_creation(caplog):
    with caplog.at_level(logging.INFO):
        pool = make_pool(
            "mha", dtype="float16", page_size=1, layout="nhd", reserved_tokens=10_000, mode="static"
        )
    assert pool.mode is PoolMode.STATIC
    assert pool.committed_tokens == 10_000
    assert pool.committed_bytes == pool.bytes_for_tokens(10_000)
    assert "KV Cache is allocated." in caplog.text


def test_swa_pool_logs_both_sub_pools_and_sizes_them_in_ratio(caplog):
    with caplog.at_level(logging.INFO):
        pool = make_pool(
            "swa", dtype="float16", page_size=4, layout="nhd", reserved_tokens=1000, mode="post-capture"
        )
    assert "[full]" in caplog.text and "[swa]" in caplog.text
    pool.finalize_backing(500)
    assert pool.committed_tokens == 500 and pool.swa_committed_tokens == 300
    assert pool.full_to_swa[:4].tolist() == [0, 1, 2, 3]


def test_swa_pool_writes_window_layers_through_the_mapping():
    pool = make_pool("swa", dtype="float32", page_size=1, layout="nhd", reserved_tokens=100, mode="static")
    pool.full_to_swa[50] = 7
    k = torch.randn(1, 2, 16)
    pool.set_kv(0, torch.tensor([50]), k, k)
    window_k, _ = pool.get_kv_buffer(0)
    assert torch.equal(window_k[7], k[0])
    pool.set_kv(1, torch.tensor([50]), k, k)  # a full layer: no translation
    assert torch.equal(pool.get_kv_buffer(1)[0][50], k[0])


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_fp8_pool_stores_e4m3_values(layout):
    pool = make_pool("mha", dtype="fp8_e4m3", page_size=4, layout=layout, reserved_tokens=64, mode="static")
    values = torch.tensor([0.5, -1.0, 2.0, 448.0]).repeat(18).reshape(1, 3, 24)
    pool.set_kv(1, torch.tensor([9]), values, values)
    k, _ = pool.get_kv_buffer(1)
    stored = k[9] if layout == "nhd" else k[2, :, 1]
    assert stored.dtype == torch.float8_e4m3fn
    assert torch.equal(stored.float(), values[0])


def test_mla_value_buffer_is_the_latent_prefix():
    pool = make_pool("mla", dtype="bfloat16", page_size=1, layout="nhd", reserved_tokens=32, mode="static")
    latent = torch.randn(1, 1, 40)
    pool.set_kv(0, torch.tensor([5]), latent)
    k, v = pool.get_kv_buffer(0)
    assert v.shape[-1] == 32 and v.data_ptr() == k.data_ptr()
    assert torch.equal(v[5], latent[0, :, :32].bfloat16())


def test_finalize_beyond_the_upper_bound_says_what_was_reserved():
    pool = make_pool(
        "mha", dtype="float16", page_size=1, layout="nhd", reserved_tokens=100, mode="post-capture"
    )
    with pytest.raises(ValueError, match="upper bound is 100"):
        pool.finalize_backing(101)


def test_failed_finalize_leaves_the_pool_backed_as_before():
    arena = KvArena(HostVmm(granularity_bytes=GRANULE, capacity_bytes=2 * MIB), 4096 * MIB, label="tight")
    pool = make_pool(
        "mha",
        dtype="float32",
        page_size=1,
        layout="nhd",
        reserved_tokens=100_000,
        mode="post-capture",
        arena=arena,
    )
    pool.ensure_prefix()
    before = pool.committed_bytes
    with pytest.raises(CommitError):
        pool.finalize_backing(50_000)
    assert pool.committed_bytes == before
    tokens = pool.finalize_backing(pool.max_tokens_within(2 * MIB))
    assert tokens > 0


def test_closing_a_pool_releases_its_own_arena():
    pool = MHAKVPool(
        KVPoolSpec.of(dtype="float32", page_size=1, layout=KVLayout.TOKEN_MAJOR, device="cpu"),
        reserved_tokens=100,
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
    )
    vmm = pool.arena.vmm
    assert vmm.committed_bytes > 0
    pool.close()
    assert vmm.committed_bytes == 0


def test_static_pool_over_plain_memory_needs_no_vmm():
    from snugkv.memory.vmm_plain import PlainMemory

    arena = KvArena(PlainMemory("cpu"), 64 * MIB, label="plain")
    pool = MHAKVPool(
        KVPoolSpec.of(dtype="bfloat16", page_size=4, layout="hnd", device="cpu", mode="static"),
        reserved_tokens=256,
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        arena=arena,
    )
    values = torch.randn(2, 2, 8)
    pool.set_kv(1, torch.tensor([4, 259]), values, values)
    k, _ = pool.get_kv_buffer(1)
    assert torch.equal(k[64, :, 3], values[1].bfloat16())
    assert pool.committed_tokens == 256


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_a_draft_models_layers_share_the_slots_and_the_bytes_of_the_pool(layout):
    """A draft of another shape (5 layers of 1 head of 8) beside the model's 2 layers of 3 heads of
    24: one more token costs both, the draft's layers are addressed from 0 and write only their own
    buffers, and a page move or a page view carries the draft's bytes with the model's."""
    spec = KVPoolSpec.of(dtype="float32", page_size=4, layout=layout, device="cpu", mode="static")
    arena = KvArena(HostVmm(granularity_bytes=GRANULE), 64 * MIB, label="test")
    plain = MHAKVPool(spec, reserved_tokens=64, num_layers=2, num_kv_heads=3, head_dim=24, arena=arena)
    pool = MHAKVPool(
        spec,
        reserved_tokens=64,
        num_layers=2,
        num_kv_heads=3,
        head_dim=24,
        arena=KvArena(HostVmm(granularity_bytes=GRANULE), 64 * MIB, label="test"),
        draft=DraftKvShape(num_layers=5, num_kv_heads=1, head_dim=8),
    )
    assert pool.draft_bytes_per_token == 5 * 2 * 1 * 8 * 4
    assert pool.bytes_per_token == plain.bytes_per_token + pool.draft_bytes_per_token
    assert plain.draft_bytes_per_token == 0 and plain.draft_kv() is None
    draft = pool.draft_kv()
    assert draft is not None
    slots = torch.tensor([5, 9])
    k, v = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    before = [torch.cat([b[slots] for b in pool.get_kv_buffer(layer)]).clone() for layer in range(2)]
    draft.set_kv(4, slots, k, v)
    draft_k, draft_v = draft.get_kv_buffer(4)
    if layout == "hnd":
        torch.testing.assert_close(draft_k[slots // 4, :, slots % 4], k)
        torch.testing.assert_close(draft_v[slots // 4, :, slots % 4], v)
    else:
        torch.testing.assert_close(draft_k[slots], k)
        torch.testing.assert_close(draft_v[slots], v)
    after = [torch.cat([b[slots] for b in pool.get_kv_buffer(layer)]) for layer in range(2)]
    assert all(torch.equal(x, y) for x, y in zip(before, after))  # the model's layers untouched
    assert len(pool.page_views()) == 2 + 5  # a host-tier copy carries the draft's pages too
    page_bytes = sum(view.shape[1] for view in pool.page_views())
    assert page_bytes == 4 * pool.bytes_per_token
