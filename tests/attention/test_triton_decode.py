"""Paged split-KV decode attention against a dense float64 reference.

On CPU the kernels run in the Triton interpreter (see conftest.py) at tiny shapes; the `cuda`
tests run real shapes in bf16 on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

from snugkv.attention.triton_decode import decode_attention, decode_workspace
from tests.attention.paged_kv_reference import (
    DEVICE,
    PagedKV,
    dense_attention,
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
class DecodeCase:
    q: torch.Tensor
    pool: PagedKV
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.q.shape[-1])


def build_case(
    seed: int,
    *,
    batch: int = 3,
    num_kv_heads: int = 2,
    group: int = 1,
    k_dim: int = 64,
    v_dim: int | None = None,
    page_size: int = 4,
    layout: str = "nhd",
    kv_dtype: torch.dtype = torch.float32,
    q_dtype: torch.dtype = torch.float32,
    max_seq: int = 40,
    seq_lens: list[int] | None = None,
    mla: bool = False,
    with_slot_map: bool = False,
    device: str = DEVICE,
) -> DecodeCase:
    gen = torch.Generator().manual_seed(seed)
    data_gen = torch.Generator(device=device).manual_seed(seed)
    v_dim = k_dim if v_dim is None else v_dim
    lengths = seq_lens or torch.randint(1, max_seq + 1, (batch,), generator=gen).tolist()
    num_tokens = math.ceil((sum(lengths) + 5) / page_size) * page_size
    slot_rows = scattered_slots(gen, lengths, page_size, num_tokens)
    table, req_pool_indices = make_table(gen, slot_rows, max(lengths) + 3, len(lengths) + 3)
    kv_slot_map = None
    num_slots = num_tokens + page_size
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
    q = torch.randn(len(lengths), num_kv_heads * group, k_dim, generator=data_gen, device=device).to(q_dtype)
    return DecodeCase(
        q=q,
        pool=PagedKV(k_buffer, v_buffer, page_size, layout, kv_slot_map),
        req_to_token=table.to(device),
        req_pool_indices=req_pool_indices.to(device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
    )


def run_kernel(
    case: DecodeCase,
    *,
    sliding_window: int | None = None,
    num_kv_splits: int = 4,
    out: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    batch, num_q_heads, _ = case.q.shape
    if out is None:
        out = torch.empty(
            batch, num_q_heads, case.pool.v_buffer.shape[-1], dtype=case.q.dtype, device=case.q.device
        )
    partial_out, partial_lse = workspace if workspace is not None else (None, None)
    return decode_attention(
        case.q,
        case.pool.k_buffer,
        case.pool.v_buffer,
        out,
        case.req_to_token,
        case.req_pool_indices,
        case.seq_lens,
        sm_scale=case.sm_scale,
        page_size=case.pool.page_size,
        layout=case.pool.layout,
        sliding_window=sliding_window,
        kv_slot_map=case.pool.kv_slot_map,
        num_kv_splits=num_kv_splits,
        partial_out=partial_out,
        partial_lse=partial_lse,
    )


def reference(case: DecodeCase, *, sliding_window: int | None = None) -> torch.Tensor:
    rows = []
    for b, (req, seq_len) in enumerate(zip(case.req_pool_indices.tolist(), case.seq_lens.tolist())):
        k, v = pool_rows(case.pool, case.req_to_token[req, :seq_len])
        positions = torch.tensor([seq_len - 1])
        rows.append(dense_attention(case.q[b : b + 1], k, v, positions, case.sm_scale, sliding_window))
    return torch.cat(rows)


@pytest.mark.parametrize("k_dim", [64, 80])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_matches_dense_attention_over_scattered_slots(
    page_size: int, layout: str, group: int, k_dim: int
) -> None:
    case = build_case(
        page_size * 100 + group * 10 + k_dim, page_size=page_size, layout=layout, group=group, k_dim=k_dim
    )
    assert relative_error(run_kernel(case), reference(case)) < FP32_BAND


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_decode_mla_reads_value_as_strided_view_of_latent(layout: str) -> None:
    # Hq = 20 puts two head blocks on the single latent KV head.
    case = build_case(7, num_kv_heads=1, group=20, k_dim=48, v_dim=32, mla=True, layout=layout)
    assert not case.pool.v_buffer.is_contiguous()
    assert relative_error(run_kernel(case), reference(case)) < FP32_BAND


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_decode_fp8_cache_matches_reference_on_the_same_fp8_values(layout: str, q_dtype: torch.dtype) -> None:
    case = build_case(11, group=3, k_dim=80, layout=layout, kv_dtype=torch.float8_e4m3fn, q_dtype=q_dtype)
    band = {torch.float32: FP32_BAND, torch.float16: FP16_BAND, torch.bfloat16: BF16_BAND}[q_dtype]
    assert relative_error(run_kernel(case), reference(case)) < band


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_16_bit_cache_stays_in_its_band(dtype: torch.dtype) -> None:
    case = build_case(13, group=3, kv_dtype=dtype, q_dtype=dtype, layout="hnd")
    band = FP16_BAND if dtype == torch.float16 else BF16_BAND
    assert relative_error(run_kernel(case), reference(case)) < band


@pytest.mark.parametrize("sliding_window", [1, 5, 17])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_decode_sliding_window_reads_window_sub_pool_through_slot_map(
    layout: str, sliding_window: int
) -> None:
    case = build_case(17 + sliding_window, group=3, layout=layout, max_seq=50, with_slot_map=True)
    expected = reference(case, sliding_window=sliding_window)
    assert relative_error(run_kernel(case, sliding_window=sliding_window), expected) < FP32_BAND


def test_decode_sliding_window_without_slot_map() -> None:
    case = build_case(19, page_size=1, group=3, k_dim=80, max_seq=60)
    assert relative_error(run_kernel(case, sliding_window=9), reference(case, sliding_window=9)) < FP32_BAND


@pytest.mark.parametrize("num_kv_splits", [1, 3, 8])
def test_decode_split_count_only_changes_work_partition(num_kv_splits: int) -> None:
    # Lengths 1 and 2 leave most splits empty; 63 spans several blocks per split.
    case = build_case(23, group=3, seq_lens=[1, 2, 63, 17])
    assert relative_error(run_kernel(case, num_kv_splits=num_kv_splits), reference(case)) < FP32_BAND


def test_decode_ignores_stale_workspace_and_honours_output_strides() -> None:
    case = build_case(29, group=3, k_dim=80)
    batch, num_q_heads, _ = case.q.shape
    wide_q = torch.randn(batch, num_q_heads, 2 * 80, device=DEVICE)
    wide_q[:, :, ::2] = case.q
    case = replace(case, q=wide_q[:, :, ::2])
    assert not case.q.is_contiguous()
    wide_out = torch.zeros(batch, 2 * num_q_heads, 80, device=DEVICE)
    out = wide_out[:, ::2]
    partial_out, partial_lse = decode_workspace(batch, num_q_heads, 80, 4, case.q.device)
    partial_out.fill_(float("nan"))
    partial_lse.fill_(float("nan"))
    run_kernel(case, out=out, workspace=(partial_out, partial_lse))
    assert relative_error(out, reference(case)) < FP32_BAND
    assert torch.all(wide_out[:, 1::2] == 0), "the kernel wrote outside the output view"


def test_decode_padding_row_attends_to_the_dummy_slot() -> None:
    case = build_case(31, group=3, page_size=4)
    padded = replace(
        case,
        req_pool_indices=torch.tensor(
            [0, *case.req_pool_indices[1:].tolist()], dtype=torch.int32, device=DEVICE
        ),
        seq_lens=torch.tensor([1, *case.seq_lens[1:].tolist()], dtype=torch.int32, device=DEVICE),
    )
    out = run_kernel(padded)
    assert relative_error(out, reference(padded)) < FP32_BAND
    dummy_v = padded.pool.v_buffer[0, :, 0] if padded.pool.layout == "hnd" else padded.pool.v_buffer[0]
    torch.testing.assert_close(out[0], dummy_v.repeat_interleave(3, dim=0), rtol=1e-6, atol=1e-6)


def test_decode_rejects_mismatched_layout() -> None:
    case = build_case(37, layout="hnd")
    with pytest.raises(ValueError, match="nhd"):
        decode_attention(
            case.q,
            case.pool.k_buffer,
            case.pool.v_buffer,
            torch.empty_like(case.q),
            case.req_to_token,
            case.req_pool_indices,
            case.seq_lens,
            sm_scale=case.sm_scale,
            page_size=case.pool.page_size,
            layout="nhd",
        )


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_decode_real_shapes_bf16_on_gpu(page_size: int, layout: str) -> None:
    gen = torch.Generator().manual_seed(page_size)
    lengths = torch.randint(1024, 4097, (64,), generator=gen).tolist()
    case = build_case(
        41,
        num_kv_heads=8,
        group=4,
        k_dim=128,
        page_size=page_size,
        layout=layout,
        kv_dtype=torch.bfloat16,
        q_dtype=torch.bfloat16,
        seq_lens=lengths,
        device="cuda",
    )
    out = run_kernel(case, num_kv_splits=16)
    assert relative_error(out, reference(case)) < BF16_BAND


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_decode_mla_576_512_on_gpu(kv_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(1024, 4097, (32,), generator=gen).tolist()
    case = build_case(
        43,
        num_kv_heads=1,
        group=16,
        k_dim=576,
        v_dim=512,
        page_size=16,
        kv_dtype=kv_dtype,
        q_dtype=torch.bfloat16,
        seq_lens=lengths,
        mla=True,
        device="cuda",
    )
    out = run_kernel(case, num_kv_splits=16)
    assert relative_error(out, reference(case)) < BF16_BAND


@pytest.mark.cuda
def test_decode_sliding_window_with_slot_map_on_gpu() -> None:
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1024, 4097, (16,), generator=gen).tolist()
    case = build_case(
        47,
        num_kv_heads=8,
        group=4,
        k_dim=128,
        page_size=16,
        layout="hnd",
        kv_dtype=torch.bfloat16,
        q_dtype=torch.bfloat16,
        seq_lens=lengths,
        with_slot_map=True,
        device="cuda",
    )
    out = run_kernel(case, sliding_window=1024, num_kv_splits=16)
    assert relative_error(out, reference(case, sliding_window=1024)) < BF16_BAND
