"""Paged extend/prefill attention and the KV store against a dense float64 reference.

On CPU the kernels run in the Triton interpreter (see conftest.py) at tiny shapes; the `cuda`
tests run real shapes in bf16 on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

from snugkv.attention.triton_decode import decode_attention
from snugkv.attention.triton_extend import ExtendLaunch, extend_attention
from snugkv.attention.triton_store import store_kv
from tests.attention.paged_kv_reference import (
    DEVICE,
    PagedKV,
    dense_attention,
    gather_kv,
    make_kv_buffers,
    make_table,
    pool_rows,
    relative_error,
    scattered_slots,
)

FP32_BAND = 2e-5
FP16_BAND = 2e-3
BF16_BAND = 2e-2


@dataclass(frozen=True, slots=True)
class ExtendCase:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pool: PagedKV
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    out_cache_loc: torch.Tensor

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.q.shape[-1])


def build_case(
    seed: int,
    *,
    prefix_lens: list[int] | None = None,
    extend_lens: list[int] | None = None,
    num_kv_heads: int = 2,
    group: int = 1,
    k_dim: int = 64,
    v_dim: int | None = None,
    page_size: int = 4,
    layout: str = "nhd",
    kv_dtype: torch.dtype = torch.float32,
    q_dtype: torch.dtype = torch.float32,
    mla: bool = False,
    with_slot_map: bool = False,
    device: str = DEVICE,
) -> ExtendCase:
    gen = torch.Generator().manual_seed(seed)
    data_gen = torch.Generator(device=device).manual_seed(seed)
    v_dim = k_dim if v_dim is None else v_dim
    if prefix_lens is None:
        prefix_lens = [0, *torch.randint(1, 40, (2,), generator=gen).tolist()]
    if extend_lens is None:
        extend_lens = torch.randint(1, 24, (len(prefix_lens),), generator=gen).tolist()
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_tokens = math.ceil((sum(seq_lens) + 3) / page_size) * page_size
    slot_rows = scattered_slots(gen, seq_lens, page_size, num_tokens)
    table, req_pool_indices = make_table(gen, slot_rows, max(seq_lens) + 2, len(seq_lens) + 2)
    num_slots = num_tokens + page_size
    kv_slot_map = None
    if with_slot_map:
        window_tokens = math.ceil(num_tokens / 2 / page_size) * page_size
        kv_slot_map = torch.randint(page_size, page_size + window_tokens, (num_slots,), generator=gen)
        kv_slot_map[:page_size] = torch.arange(page_size)
        kv_slot_map = kv_slot_map.to(device)
        num_slots = window_tokens + page_size
    k_buffer, v_buffer = make_kv_buffers(
        data_gen,
        num_slots=num_slots,
        page_size=page_size,
        layout=layout,
        num_kv_heads=num_kv_heads,
        k_dim=k_dim,
        v_dim=v_dim,
        dtype=kv_dtype,
        mla=mla,
    )
    total = sum(extend_lens)
    q = torch.randn(total, num_kv_heads * group, k_dim, generator=data_gen, device=device).to(q_dtype)
    k = torch.randn(total, num_kv_heads, k_dim, generator=data_gen, device=device).to(q_dtype)
    v = (
        k[..., :v_dim]
        if mla
        else torch.randn(total, num_kv_heads, v_dim, generator=data_gen, device=device).to(q_dtype)
    )
    out_cache_loc = torch.cat([slots[p:] for slots, p in zip(slot_rows, prefix_lens)])

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return ExtendCase(
        q=q,
        k=k,
        v=v,
        pool=PagedKV(k_buffer, v_buffer, page_size, layout, kv_slot_map),
        req_to_token=table.to(device),
        req_pool_indices=req_pool_indices.to(device),
        prefix_lens=ints(prefix_lens),
        extend_lens=ints(extend_lens),
        extend_start_loc=ints([sum(extend_lens[:i]) for i in range(len(extend_lens))]),
        out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
    )


def run_kernel(
    case: ExtendCase,
    *,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    with_max_extend_len: bool = True,
    launch: ExtendLaunch | None = None,
) -> torch.Tensor:
    if out is None:
        out = torch.empty(*case.q.shape[:2], case.v.shape[-1], dtype=case.q.dtype, device=case.q.device)
    return extend_attention(
        case.q,
        case.k,
        case.v,
        out,
        case.pool.k_buffer,
        case.pool.v_buffer,
        case.req_to_token,
        case.req_pool_indices,
        case.prefix_lens,
        case.extend_lens,
        case.extend_start_loc,
        sm_scale=case.sm_scale,
        page_size=case.pool.page_size,
        layout=case.pool.layout,
        sliding_window=sliding_window,
        kv_slot_map=case.pool.kv_slot_map,
        launch=launch,
        max_extend_len=int(case.extend_lens.max()) if with_max_extend_len else None,
    )


def reference(case: ExtendCase, *, sliding_window: int | None = None) -> torch.Tensor:
    rows = []
    for req, prefix_len, extend_len, start in zip(
        case.req_pool_indices.tolist(),
        case.prefix_lens.tolist(),
        case.extend_lens.tolist(),
        case.extend_start_loc.tolist(),
    ):
        prefix_k, prefix_v = pool_rows(case.pool, case.req_to_token[req, :prefix_len])
        new = slice(start, start + extend_len)
        k = torch.cat([prefix_k, case.k[new].double()])
        v = torch.cat([prefix_v, case.v[new].double()])
        positions = prefix_len + torch.arange(extend_len)
        rows.append(dense_attention(case.q[new], k, v, positions, case.sm_scale, sliding_window))
    return torch.cat(rows)


@pytest.mark.parametrize("k_dim", [64, 80])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_extend_matches_dense_attention_over_prefix_and_new_tokens(
    page_size: int, layout: str, group: int, k_dim: int
) -> None:
    case = build_case(
        page_size * 100 + group * 10 + k_dim, page_size=page_size, layout=layout, group=group, k_dim=k_dim
    )
    assert relative_error(run_kernel(case), reference(case)) < FP32_BAND


def test_extend_without_prefix_is_causal_prefill() -> None:
    case = build_case(3, prefix_lens=[0, 0, 0], extend_lens=[1, 33, 17], group=3, k_dim=80)
    assert relative_error(run_kernel(case), reference(case)) < FP32_BAND


def test_extend_grid_without_max_extend_len_gives_the_same_answer() -> None:
    case = build_case(5, group=3)
    assert relative_error(run_kernel(case, with_max_extend_len=False), reference(case)) < FP32_BAND


@pytest.mark.parametrize(
    "launch", [ExtendLaunch(16, 16, 4, 1), ExtendLaunch(16, 32, 4, 1), ExtendLaunch(64, 16, 4, 1)]
)
def test_extend_launch_shapes_give_the_same_answer(launch: ExtendLaunch) -> None:
    """Blocks of new tokens run last-first; every block size must still cover every row's tokens."""
    case = build_case(11, prefix_lens=[0, 9, 40], extend_lens=[70, 1, 33], group=3)
    assert relative_error(run_kernel(case, launch=launch), reference(case)) < FP32_BAND


def test_extend_decode_rows_mixed_with_prefill_rows() -> None:
    case = build_case(7, prefix_lens=[30, 0, 12, 5], extend_lens=[1, 20, 1, 40], group=3)
    assert relative_error(run_kernel(case), reference(case)) < FP32_BAND


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_extend_mla_reads_value_as_strided_view_of_latent(layout: str) -> None:
    case = build_case(9, num_kv_heads=1, group=5, k_dim=48, v_dim=32, mla=True, layout=layout)
    assert not case.v.is_contiguous() and not case.pool.v_buffer.is_contiguous()
    assert relative_error(run_kernel(case), reference(case)) < FP32_BAND


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_extend_fp8_cache_matches_reference_on_the_same_fp8_values(layout: str, q_dtype: torch.dtype) -> None:
    case = build_case(11, group=3, k_dim=80, layout=layout, kv_dtype=torch.float8_e4m3fn, q_dtype=q_dtype)
    band = {torch.float32: FP32_BAND, torch.float16: FP16_BAND, torch.bfloat16: BF16_BAND}[q_dtype]
    assert relative_error(run_kernel(case), reference(case)) < band


@pytest.mark.parametrize("sliding_window", [1, 4, 13])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_extend_sliding_window_reads_window_sub_pool_through_slot_map(
    layout: str, sliding_window: int
) -> None:
    case = build_case(13 + sliding_window, group=3, layout=layout, with_slot_map=True)
    expected = reference(case, sliding_window=sliding_window)
    assert relative_error(run_kernel(case, sliding_window=sliding_window), expected) < FP32_BAND


def test_extend_honours_query_and_output_strides() -> None:
    case = build_case(15, group=3, k_dim=80)
    tokens, num_q_heads, _ = case.q.shape
    wide_q = torch.randn(tokens, num_q_heads, 160, device=DEVICE)
    wide_q[..., 1::2] = case.q
    wide_out = torch.zeros(tokens, 2 * num_q_heads, 80, device=DEVICE)
    run_kernel(replace(case, q=wide_q[..., 1::2]), out=wide_out[:, 1::2])
    assert relative_error(wide_out[:, 1::2], reference(case)) < FP32_BAND
    assert torch.all(wide_out[:, ::2] == 0), "the kernel wrote outside the output view"


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_store_writes_each_slot_in_both_layouts(layout: str) -> None:
    case = build_case(17, page_size=4, layout=layout, group=3)
    store_kv(
        case.pool.k_buffer, case.pool.v_buffer, case.out_cache_loc, case.k, case.v, page_size=4, layout=layout
    )
    torch.testing.assert_close(gather_kv(case.pool.k_buffer, case.out_cache_loc, layout, 4), case.k.double())
    torch.testing.assert_close(gather_kv(case.pool.v_buffer, case.out_cache_loc, layout, 4), case.v.double())


def test_store_fp8_saturates_instead_of_nan() -> None:
    k_buffer = torch.zeros(8, 1, 4, dtype=torch.float8_e4m3fn, device=DEVICE)
    k = torch.tensor([[[1000.0, -1000.0, 0.5, 3.0]]], device=DEVICE)
    store_kv(k_buffer, None, torch.tensor([5], device=DEVICE), k, None, page_size=1)
    assert k_buffer[5].float().tolist() == [[448.0, -448.0, 0.5, 3.0]]


def test_store_mla_latent_fills_the_value_view() -> None:
    k_buffer = torch.zeros(3, 1, 4, 6, device=DEVICE)  # hnd, page size 4
    latent = torch.randn(2, 1, 6, device=DEVICE)
    store_kv(
        k_buffer,
        k_buffer[..., :4],
        torch.tensor([5, 10], device=DEVICE),
        latent,
        None,
        page_size=4,
        layout="hnd",
    )
    torch.testing.assert_close(k_buffer[1, :, 1], latent[0])
    torch.testing.assert_close(k_buffer[2, :, 2][..., :4], latent[1, :, :4])


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_last_extend_token_agrees_with_decode_after_store(layout: str) -> None:
    case = build_case(19, page_size=4, layout=layout, group=3, kv_dtype=torch.float16, q_dtype=torch.float16)
    store_kv(
        case.pool.k_buffer, case.pool.v_buffer, case.out_cache_loc, case.k, case.v, page_size=4, layout=layout
    )
    extend_out = run_kernel(case)
    last = case.extend_start_loc + case.extend_lens - 1
    decode_out = torch.empty_like(extend_out[last])
    decode_attention(
        case.q[last],
        case.pool.k_buffer,
        case.pool.v_buffer,
        decode_out,
        case.req_to_token,
        case.req_pool_indices,
        case.prefix_lens + case.extend_lens,
        sm_scale=case.sm_scale,
        page_size=4,
        layout=layout,
    )
    assert relative_error(decode_out, extend_out[last]) < FP16_BAND


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_extend_real_shapes_bf16_on_gpu(page_size: int, layout: str) -> None:
    gen = torch.Generator().manual_seed(page_size)
    prefix_lens = [0, *torch.randint(1, 3073, (7,), generator=gen).tolist()]
    extend_lens = torch.randint(1, 1025, (8,), generator=gen).tolist()
    case = build_case(
        51,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        num_kv_heads=8,
        group=4,
        k_dim=128,
        page_size=page_size,
        layout=layout,
        kv_dtype=torch.bfloat16,
        q_dtype=torch.bfloat16,
        device="cuda",
    )
    assert relative_error(run_kernel(case), reference(case)) < BF16_BAND


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_extend_mla_576_512_on_gpu(kv_dtype: torch.dtype) -> None:
    case = build_case(
        53,
        prefix_lens=[0, 700, 2048, 1500],
        extend_lens=[300, 64, 1, 513],
        num_kv_heads=1,
        group=16,
        k_dim=576,
        v_dim=512,
        page_size=16,
        kv_dtype=kv_dtype,
        q_dtype=torch.bfloat16,
        mla=True,
        device="cuda",
    )
    assert relative_error(run_kernel(case), reference(case)) < BF16_BAND


@pytest.mark.cuda
def test_extend_sliding_window_with_slot_map_on_gpu() -> None:
    case = build_case(
        55,
        prefix_lens=[0, 3000, 1200, 40],
        extend_lens=[900, 700, 1, 2000],
        num_kv_heads=8,
        group=4,
        k_dim=128,
        page_size=16,
        layout="hnd",
        kv_dtype=torch.bfloat16,
        q_dtype=torch.bfloat16,
        with_slot_map=True,
        device="cuda",
    )
    out = run_kernel(case, sliding_window=512)
    assert relative_error(out, reference(case, sliding_window=512)) < BF16_BAND
