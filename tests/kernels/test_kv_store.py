"""store_kv into a pool buffer: the reference IS triton_store.store_kv, the kernel writes the same bits."""

from __future__ import annotations

import pytest
import torch

from snugkv.attention import triton_store
from snugkv.kernels.kv_store import pool_strides, store_kv, store_kv_reference, store_kv_triton
from tests.kernels.kernel_cases import DEVICE, generator, pool_buffer, randn, same_bits, scattered_slots

# (layout, page_size): token-major always addresses one slot per row; page-major at P = 1 and 4.
LAYOUTS = [("nhd", 1), ("hnd", 1), ("hnd", 4)]
KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


def _values(gen: torch.Generator, tokens: int, heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    values = randn(gen, tokens, heads, dim, dtype=torch.float32) * 3
    values[0, 0, :2] = torch.tensor([1000.0, -1000.0])  # beyond fp8's +-448: must saturate, not NaN
    return values.to(dtype)


@pytest.mark.parametrize(("layout", "page_size"), LAYOUTS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_reference_is_triton_store_bit_for_bit(layout, page_size, kv_dtype):
    gen = generator(0)
    shape = {"num_slots": 24, "num_kv_heads": 2, "head_dim": 16, "layout": layout, "page_size": page_size}
    k_ours, v_ours = (pool_buffer(gen, **shape, dtype=kv_dtype) for _ in range(2))
    k_today, v_today = k_ours.clone(), v_ours.clone()
    loc = scattered_slots(gen, 5, 24, page_size)
    k, v = _values(gen, 5, 2, 16, torch.float32), _values(gen, 5, 2, 16, torch.float32)
    store_kv_reference(k_ours, v_ours, loc, k, v, page_size=page_size, layout=layout)
    triton_store.store_kv(k_today, v_today, loc, k, v, page_size=page_size, layout=layout)
    assert same_bits(k_ours, k_today) and same_bits(v_ours, v_today)


@pytest.mark.parametrize(("layout", "page_size"), LAYOUTS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_slot_map", [False, True])
def test_kernel_writes_the_reference_bits(layout, page_size, kv_dtype, compute_dtype, with_slot_map):
    gen = generator(1)
    tokens, heads, dim, num_slots = 6, 2, 24, 32
    shape = {"num_slots": num_slots, "num_kv_heads": heads, "head_dim": dim, "layout": layout}
    k_buf, v_buf = (
        pool_buffer(gen, **shape, page_size=page_size, dtype=kv_dtype, padded=True) for _ in range(2)
    )
    expected_k, expected_v = k_buf.clone(), v_buf.clone()
    slot_map = None
    if with_slot_map:  # a permutation keeps the translated slots distinct
        slot_map = torch.cat(
            [torch.arange(page_size), torch.randperm(num_slots - page_size, generator=gen) + page_size]
        )
        slot_map = slot_map.to(DEVICE)
    loc = scattered_slots(gen, tokens, num_slots, page_size)
    k, v = _values(gen, tokens, heads, dim, compute_dtype), _values(gen, tokens, heads, dim, compute_dtype)
    kwargs = {"page_size": page_size, "layout": layout, "kv_slot_map": slot_map}
    store_kv_triton(k_buf, v_buf, loc, k, v, **kwargs)
    store_kv_reference(expected_k, expected_v, loc, k, v, **kwargs)
    assert same_bits(k_buf, expected_k) and same_bits(v_buf, expected_v)


def test_kernel_writes_an_mla_latent_without_values():
    gen = generator(2)
    latent = pool_buffer(
        gen, num_slots=16, num_kv_heads=1, head_dim=72, layout="nhd", page_size=1, dtype=torch.bfloat16
    )
    expected = latent.clone()
    loc = scattered_slots(gen, 3, 16, 1)
    values = randn(gen, 3, 1, 72, dtype=torch.bfloat16)
    store_kv_triton(latent, latent[..., :64], loc, values, None, page_size=1)
    store_kv_reference(expected, expected[..., :64], loc, values, None, page_size=1)
    assert same_bits(latent, expected)


def test_kernel_reads_strided_values():
    gen = generator(3)
    buf = pool_buffer(
        gen, num_slots=16, num_kv_heads=2, head_dim=16, layout="hnd", page_size=4, dtype=torch.float16
    )
    expected = buf.clone()
    k = randn(gen, 4, 4, 16, dtype=torch.float16)[:, ::2]  # every other head: strided heads
    loc = scattered_slots(gen, 4, 16, 4)
    store_kv_triton(buf, buf, loc, k, k, page_size=4, layout="hnd")
    store_kv_reference(expected, expected, loc, k, k, page_size=4, layout="hnd")
    assert same_bits(buf, expected)


def test_pool_strides_refuse_a_buffer_in_the_wrong_layout():
    with pytest.raises(ValueError, match="page_size=4"):
        pool_strides(torch.empty(3, 2, 16), "hnd", 4)
    with pytest.raises(ValueError, match="layout must be one of"):
        pool_strides(torch.empty(3, 2, 16), "nhwc", 1)
    with pytest.raises(ValueError, match="does not match buffer"):
        store_kv_triton(
            torch.empty(8, 2, 16),
            None,
            torch.zeros(1, dtype=torch.long),
            torch.empty(1, 3, 16),
            None,
            page_size=1,
        )


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU dispatch")
def test_cpu_dispatch_takes_the_reference():
    buf, expected = torch.zeros(8, 1, 4), torch.zeros(8, 1, 4)
    loc, k = torch.tensor([3, 5]), torch.randn(2, 1, 4)
    store_kv(buf, buf, loc, k, k, page_size=1)
    store_kv_reference(expected, expected, loc, k, k, page_size=1)
    assert same_bits(buf, expected)


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_real_shapes_on_the_gpu(kv_dtype):
    gen = generator(4)
    for layout, page_size in (("nhd", 1), ("hnd", 16)):
        shape = {
            "num_slots": 4096,
            "num_kv_heads": 8,
            "head_dim": 128,
            "layout": layout,
            "page_size": page_size,
        }
        k_buf, v_buf = (pool_buffer(gen, **shape, dtype=kv_dtype) for _ in range(2))
        expected_k, expected_v = k_buf.clone(), v_buf.clone()
        loc = scattered_slots(gen, 1000, 4096, page_size)
        k, v = _values(gen, 1000, 8, 128, torch.bfloat16), _values(gen, 1000, 8, 128, torch.bfloat16)
        store_kv(k_buf, v_buf, loc, k, v, page_size=page_size, layout=layout)
        store_kv_reference(expected_k, expected_v, loc, k, v, page_size=page_size, layout=layout)
        assert same_bits(k_buf, expected_k) and same_bits(v_buf, expected_v)
