"""Paged decode attention in Triton: one new query token per request, split-KV flash decoding.

Algorithm. Request `b` attends over the key positions `[kv_start, seq_len)` of its table row
`req_to_token[req_pool_indices[b]]`, where `kv_start = max(seq_len - window, 0)` (0 without a
sliding window; the query sits at position `seq_len - 1`). That range is cut into `num_kv_splits`
chunks, each a multiple of BLOCK_N positions.
- Stage 1, grid `(B, Hkv * head_blocks, num_kv_splits)`: a program takes one KV head, the (up to
  BLOCK_H) query heads of its GQA group and one chunk, reads each key's slot from the table
  (then `kv_slot_map[slot]` for a window sub-pool), gathers K/V from the pool, runs an online
  base-2 softmax and writes the normalised partial output and its log-sum-exp to the workspace.
  Chunks past the end of a short request do no work and write lse = -inf.
- Stage 2, grid `(B, Hq)`: merges the splits weighted by `exp2(lse - max lse)`.

Layouts (docs/ARCHITECTURE.md). Slot `s` is read at
`(s // PAGE) * stride_page + head * stride_head + (s % PAGE) * stride_off + d * stride_dim`:
token-major "nhd" `[slots, Hkv, D]` runs with PAGE = 1 and stride_off = 0, page-major "hnd"
`[pages, Hkv, P, D]` with PAGE = P. Every stride is honoured, so MLA's value buffer (the first
`kv_lora_rank` columns of the latent buffer) and non-contiguous q/out views work as they are.
Head dims need not be powers of two: the key dim is covered by a power-of-two block plus a masked
remainder block (576 = 512 + 64, 80 = 64 + 16), the value dim by one masked block.
KV may be fp8 (e4m3fn, scale 1), fp16, bf16 or fp32; loads are upcast (fp8 to the query's 16-bit
type, exactly) and products accumulate in fp32.

What this module must never do: synchronise with the host or branch in Python on tensor values.
The grid depends only on B, the head counts and `num_kv_splits` (a maximum); sequence lengths are
read on the device, so the launch can be captured in a CUDA graph and replayed with new lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from snugkv.attention.triton_common import (
    block_scores,
    block_values,
    dot_dtype,
    key_dim_blocks,
    load_slots,
    online_softmax_step,
    slot_offsets,
    value_dim_block,
    window_or_none,
)
from snugkv.kernels.kv_store import pool_strides


@triton.jit
def _decode_partial_kernel(
    Q,
    K,
    V,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Slot_map,
    Partial_out,
    Partial_lse,
    sm_scale_log2,
    window,
    stride_q_b,
    stride_q_h,
    stride_q_d,
    stride_k_page,
    stride_k_head,
    stride_k_off,
    stride_k_dim,
    stride_v_page,
    stride_v_head,
    stride_v_off,
    stride_v_dim,
    stride_table_row,
    stride_po_b,
    stride_po_h,
    stride_po_s,
    stride_pl_b,
    stride_pl_h,
    GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_SLOT_MAP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DK_REST: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    batch = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head_block // HEAD_BLOCKS
    group_offs = (head_block % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = group_offs < GROUP
    q_heads = kv_head * GROUP + group_offs

    seq_len = tl.load(Seq_lens + batch)
    req = tl.load(Req_pool_indices + batch).to(tl.int64)
    kv_start = tl.maximum(seq_len - window, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_start = kv_start + split * chunk
    split_end = tl.minimum(split_start + chunk, seq_len)

    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q_row = Q + batch.to(tl.int64) * stride_q_b + q_heads[:, None] * stride_q_h
    q = tl.load(q_row + dk[None, :] * stride_q_d, mask=head_mask[:, None] & (dk[None, :] < DK), other=0.0)
    q = q.to(DOT_DTYPE)
    dk_rest, q_rest = dk, q  # stand-ins, unused without a remainder block
    if BLOCK_DK_REST > 0:
        dk_rest = BLOCK_DK + tl.arange(0, BLOCK_DK_REST)
        q_rest = tl.load(
            q_row + dk_rest[None, :] * stride_q_d,
            mask=head_mask[:, None] & (dk_rest[None, :] < DK),
            other=0.0,
        ).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    row_offset = req * stride_table_row
    for start in range(split_start, split_end, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        pos_mask = positions < split_end
        slots = load_slots(Req_to_token, row_offset, positions, pos_mask, Slot_map, HAS_SLOT_MAP)
        k_rows = slot_offsets(slots, kv_head, stride_k_page, stride_k_head, stride_k_off, PAGE)
        qk = block_scores(
            q, q_rest, K, k_rows, pos_mask, dk, dk_rest, stride_k_dim, DK, BLOCK_DK_REST, DOT_DTYPE
        )
        qk = tl.where(pos_mask[None, :], qk * sm_scale_log2, float("-inf"))
        v_rows = slot_offsets(slots, kv_head, stride_v_page, stride_v_head, stride_v_off, PAGE)
        v = block_values(V, v_rows, pos_mask, dv, stride_v_dim, DV)
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, DOT_DTYPE)

    has_keys = l_i > 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
    out_row = batch.to(tl.int64) * stride_po_b + q_heads * stride_po_h + split * stride_po_s
    tl.store(
        Partial_out + out_row[:, None] + dv[None, :],
        acc / l_safe[:, None],
        mask=head_mask[:, None] & (dv[None, :] < DV),
    )
    tl.store(Partial_lse + batch * stride_pl_b + q_heads * stride_pl_h + split, lse, mask=head_mask)


@triton.jit
def _decode_reduce_kernel(
    Partial_out,
    Partial_lse,
    Out,
    stride_po_b,
    stride_po_h,
    stride_po_s,
    stride_pl_b,
    stride_pl_h,
    stride_o_b,
    stride_o_h,
    stride_o_d,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    batch = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_SPLITS)
    dv = tl.arange(0, BLOCK_DV)
    dv_mask = dv < DV
    lse_row = Partial_lse + batch * stride_pl_b + head * stride_pl_h
    lse = tl.load(lse_row + splits, mask=splits < NUM_SPLITS, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    # A row with no keys at all (never produced by the engine) yields zeros rather than NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.sum(tl.exp2(lse - lse_max), 0)

    out_row = Partial_out + batch.to(tl.int64) * stride_po_b + head * stride_po_h
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for split in range(NUM_SPLITS):
        weight = tl.exp2(tl.load(lse_row + split) - lse_max)
        acc += weight * tl.load(out_row + split * stride_po_s + dv, mask=dv_mask, other=0.0)
    out = acc / tl.where(total > 0, total, 1.0)
    out_ptrs = Out + batch.to(tl.int64) * stride_o_b + head * stride_o_h + dv * stride_o_d
    tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=dv_mask)


@dataclass(frozen=True, slots=True)
class DecodeLaunch:
    """Launch shape of the split-KV stage: keys per loop step, warps, software-pipeline stages."""

    block_n: int
    num_warps: int = 4
    num_stages: int = 2


def default_decode_launch(k_head_dim: int, device: torch.device) -> DecodeLaunch:
    """Measured on the H200 (`snugkv bench attention`, docs/bench/attention.md)."""
    if device.type == "cpu":  # the interpreter: small blocks keep the CPU tests fast
        return DecodeLaunch(block_n=16)
    if k_head_dim > 256:
        return DecodeLaunch(block_n=32)
    return DecodeLaunch(block_n=128, num_warps=4, num_stages=3)


def decode_splits(batch_size: int, num_kv_heads: int, programs_wanted: int = 512) -> int:
    """Splits of each request's keys: enough programs to fill the GPU when the batch is small,
    few (less partial-result traffic) when the batch alone fills it. Depends only on the batch
    size, so a captured graph keeps it. A power of two (2 to 16; the kernels take it as a
    compile-time constant): the decode graphs' capture compiles these few values at start-up,
    so a mixed step's decode rows, whatever their count, compile nothing while serving. (With any
    value from 2 to 16, the first workload of a fresh server ran at half the speed of the same
    workload on a second server that found the kernels in Triton's disk cache: H100, a767e07.)"""
    splits = programs_wanted // max(batch_size * num_kv_heads, 1)
    return 1 << (min(max(splits, 2), 16).bit_length() - 1)


def decode_workspace(
    batch_size: int, num_q_heads: int, v_head_dim: int, num_kv_splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial_out fp32 [B, Hq, splits, Dv], partial_lse fp32 [B, Hq, splits]) for `decode_attention`."""
    partial_out = torch.empty(
        batch_size, num_q_heads, num_kv_splits, v_head_dim, dtype=torch.float32, device=device
    )
    partial_lse = torch.empty(batch_size, num_q_heads, num_kv_splits, dtype=torch.float32, device=device)
    return partial_out, partial_lse


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
    page_size: int,
    layout: str = "nhd",
    sliding_window: int | None = None,
    kv_slot_map: torch.Tensor | None = None,
    num_kv_splits: int = 8,
    partial_out: torch.Tensor | None = None,
    partial_lse: torch.Tensor | None = None,
    launch: DecodeLaunch | None = None,
) -> torch.Tensor:
    """Write softmax(q k^T * sm_scale) v over each request's cached keys into `out` and return it.

    q [B, Hq, Dk]; out [B, Hq, Dv]; k_buffer/v_buffer in `layout` with Hkv heads (Hq % Hkv == 0);
    req_to_token int32 [rows, max_context]; req_pool_indices, seq_lens int [B] on the device.
    Pass `partial_out`/`partial_lse` from `decode_workspace` to keep allocations out of a graph.
    """
    batch_size, num_q_heads, k_head_dim = q.shape
    v_head_dim = v_buffer.shape[-1]
    num_kv_heads = k_buffer.shape[1]
    if k_buffer.shape[-1] != k_head_dim:
        raise ValueError(f"q has head dim {k_head_dim} but k_buffer has {k_buffer.shape[-1]}")
    if k_buffer.dtype != v_buffer.dtype:
        raise ValueError(f"k_buffer ({k_buffer.dtype}) and v_buffer ({v_buffer.dtype}) must share a dtype")
    if num_q_heads % num_kv_heads != 0 or v_buffer.shape[1] != num_kv_heads:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of KV heads (k: {num_kv_heads}, v: {v_buffer.shape[1]})"
        )
    if tuple(out.shape) != (batch_size, num_q_heads, v_head_dim):
        raise ValueError(f"out must be {(batch_size, num_q_heads, v_head_dim)}; got {tuple(out.shape)}")
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1; got {num_kv_splits}")
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must be contiguous along the position axis (stride(1) == 1)")
    k_page, k_strides = pool_strides(k_buffer, layout, page_size)
    _, v_strides = pool_strides(v_buffer, layout, page_size)
    window = window_or_none(sliding_window)
    if partial_out is None or partial_lse is None:
        partial_out, partial_lse = decode_workspace(
            batch_size, num_q_heads, v_head_dim, num_kv_splits, q.device
        )
    if partial_out.shape[:3] != (batch_size, num_q_heads, num_kv_splits) or partial_out.stride(-1) != 1:
        raise ValueError("partial_out must be fp32 [B, Hq, num_kv_splits, >= Dv] with a contiguous last dim")

    group = num_q_heads // num_kv_heads
    launch = launch or default_decode_launch(k_head_dim, q.device)
    block_h = 16
    head_blocks = triton.cdiv(group, block_h)
    block_dk, block_dk_rest = key_dim_blocks(k_head_dim)
    _decode_partial_kernel[(batch_size, num_kv_heads * head_blocks, num_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        kv_slot_map if kv_slot_map is not None else req_to_token,
        partial_out,
        partial_lse,
        sm_scale * 1.4426950408889634,
        window,
        *q.stride(),
        *k_strides,
        *v_strides,
        req_to_token.stride(0),
        *partial_out.stride()[:3],
        *partial_lse.stride()[:2],
        GROUP=group,
        HEAD_BLOCKS=head_blocks,
        NUM_SPLITS=num_kv_splits,
        PAGE=k_page,
        HAS_SLOT_MAP=kv_slot_map is not None,
        DK=k_head_dim,
        DV=v_head_dim,
        BLOCK_DK=block_dk,
        BLOCK_DK_REST=block_dk_rest,
        BLOCK_DV=value_dim_block(v_head_dim),
        BLOCK_H=block_h,
        BLOCK_N=launch.block_n,
        DOT_DTYPE=dot_dtype(q.dtype, k_buffer.dtype, q.device),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    _decode_reduce_kernel[(batch_size, num_q_heads)](
        partial_out,
        partial_lse,
        out,
        *partial_out.stride()[:3],
        *partial_lse.stride()[:2],
        *out.stride(),
        NUM_SPLITS=num_kv_splits,
        BLOCK_SPLITS=triton.next_power_of_2(num_kv_splits),
        DV=v_head_dim,
        BLOCK_DV=value_dim_block(v_head_dim),
        num_warps=4,
    )
    return out
