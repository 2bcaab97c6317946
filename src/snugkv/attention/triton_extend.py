"""Paged extend (prefill) attention in Triton: new tokens attend to their cached prefix and, causally, to each other.

Algorithm. Row `b` adds `extend_lens[b]` tokens, stored from `extend_start_loc[b]` in the
concatenated q/k/v extend tensors, on top of `prefix_lens[b]` cached tokens. New token `i` sits at
position `prefix_len + i`. A program takes one query head and BLOCK_M new tokens of one row
(grid `(B, Hq, cdiv(max_extend_len, BLOCK_M))`; blocks past a row's end do nothing) and runs one
online base-2 softmax over two key sources:
1. the prefix, read through `req_to_token[req_pool_indices[b], :prefix_len]` (then
   `kv_slot_map[slot]` for a window sub-pool) from the pool buffers, upcast on load;
2. the new tokens themselves, read straight from the extend k/v tensors with a causal mask.
A key at position kp is visible from a query at qp iff `kp <= qp and qp - kp < window`; both loops
start at the first position any query of the block can see, so a sliding window skips the rest.
Pure causal prefill is the case `prefix_lens == 0`.

Layouts, dtypes and strides are handled as in `triton_decode` (same slot addressing, the key dim
split into a power-of-two block plus a masked remainder, fp8 upcast on load, fp32 accumulation).
Extend k/v are the compute-dtype tensors the caller also wrote into the pool, so new tokens see
themselves at full precision even over an fp8 cache.

What this module must never do: synchronise with the host. Pass `max_extend_len` from the
scheduler's host-side lengths; without it the grid assumes one row may hold every new token.
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
def _extend_kernel(
    Q,
    K_extend,
    V_extend,
    Out,
    K_buffer,
    V_buffer,
    Req_to_token,
    Req_pool_indices,
    Prefix_lens,
    Extend_lens,
    Extend_start_loc,
    Slot_map,
    sm_scale_log2,
    window,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_ke_t,
    stride_ke_h,
    stride_ke_d,
    stride_ve_t,
    stride_ve_h,
    stride_ve_d,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    stride_k_page,
    stride_k_head,
    stride_k_off,
    stride_k_dim,
    stride_v_page,
    stride_v_head,
    stride_v_off,
    stride_v_dim,
    stride_table_row,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_SLOT_MAP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DK_REST: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREFIX_DOT_DTYPE: tl.constexpr,
    EXTEND_DOT_DTYPE: tl.constexpr,
):
    batch = tl.program_id(0)
    head = tl.program_id(1)
    # Last query block first: under the causal mask it has the most keys to read, and the blocks
    # launched last then are the short ones (no long tail of a few programs at the end).
    m_start = (tl.num_programs(2) - 1 - tl.program_id(2)) * BLOCK_M
    extend_len = tl.load(Extend_lens + batch)
    if m_start < extend_len:
        kv_head = head // GROUP
        prefix_len = tl.load(Prefix_lens + batch)
        start_loc = tl.load(Extend_start_loc + batch).to(tl.int64)
        req = tl.load(Req_pool_indices + batch).to(tl.int64)

        rows = m_start + tl.arange(0, BLOCK_M)
        row_mask = rows < extend_len
        tokens = start_loc + rows
        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        q_rows = Q + tokens[:, None] * stride_q_t + head * stride_q_h
        q = tl.load(q_rows + dk[None, :] * stride_q_d, mask=row_mask[:, None] & (dk[None, :] < DK), other=0.0)
        dk_rest, q_rest = dk, q  # stand-ins, unused without a remainder block
        if BLOCK_DK_REST > 0:
            dk_rest = BLOCK_DK + tl.arange(0, BLOCK_DK_REST)
            q_rest = tl.load(
                q_rows + dk_rest[None, :] * stride_q_d,
                mask=row_mask[:, None] & (dk_rest[None, :] < DK),
                other=0.0,
            )

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

        # Cached prefix: every prefix key precedes every new token, so only the window can hide it.
        prefix_q, prefix_q_rest = q.to(PREFIX_DOT_DTYPE), q_rest.to(PREFIX_DOT_DTYPE)
        q_positions = prefix_len + rows
        row_offset = req * stride_table_row
        for start in range(tl.maximum(prefix_len + m_start - window + 1, 0), prefix_len, BLOCK_N):
            key_pos = start + tl.arange(0, BLOCK_N)
            key_mask = key_pos < prefix_len
            slots = load_slots(Req_to_token, row_offset, key_pos, key_mask, Slot_map, HAS_SLOT_MAP)
            k_rows = slot_offsets(slots, kv_head, stride_k_page, stride_k_head, stride_k_off, PAGE)
            qk = block_scores(
                prefix_q,
                prefix_q_rest,
                K_buffer,
                k_rows,
                key_mask,
                dk,
                dk_rest,
                stride_k_dim,
                DK,
                BLOCK_DK_REST,
                PREFIX_DOT_DTYPE,
            )
            visible = key_mask[None, :] & (q_positions[:, None] - key_pos[None, :] < window)
            qk = tl.where(visible, qk * sm_scale_log2, float("-inf"))
            v_rows = slot_offsets(slots, kv_head, stride_v_page, stride_v_head, stride_v_off, PAGE)
            v = block_values(V_buffer, v_rows, key_mask, dv, stride_v_dim, DV)
            m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, PREFIX_DOT_DTYPE)

        # New tokens, causally; positions here are offsets into the row's extend range.
        extend_q, extend_q_rest = q.to(EXTEND_DOT_DTYPE), q_rest.to(EXTEND_DOT_DTYPE)
        extend_end = tl.minimum(m_start + BLOCK_M, extend_len)
        for start in range(tl.maximum(m_start - window + 1, 0), extend_end, BLOCK_N):
            key_idx = start + tl.arange(0, BLOCK_N)
            key_mask = key_idx < extend_end
            key_tokens = start_loc + key_idx
            k_rows = key_tokens * stride_ke_t + kv_head * stride_ke_h
            qk = block_scores(
                extend_q,
                extend_q_rest,
                K_extend,
                k_rows,
                key_mask,
                dk,
                dk_rest,
                stride_ke_d,
                DK,
                BLOCK_DK_REST,
                EXTEND_DOT_DTYPE,
            )
            distance = rows[:, None] - key_idx[None, :]
            visible = key_mask[None, :] & (distance >= 0) & (distance < window)
            qk = tl.where(visible, qk * sm_scale_log2, float("-inf"))
            v_rows = key_tokens * stride_ve_t + kv_head * stride_ve_h
            v = block_values(V_extend, v_rows, key_mask, dv, stride_ve_d, DV)
            m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, EXTEND_DOT_DTYPE)

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_ptrs = Out + tokens[:, None] * stride_o_t + head * stride_o_h + dv[None, :] * stride_o_d
        tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=row_mask[:, None] & (dv[None, :] < DV))


@dataclass(frozen=True)
class ExtendLaunch:
    """Launch shape: new tokens per program (BLOCK_M), keys per loop step, warps, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


def default_extend_launch(k_head_dim: int, device: torch.device, prefix_heavy: bool = False) -> ExtendLaunch:
    """Measured on the H200 (`snugkv bench attention --kinds extend`, docs/bench/attention.md):
    with a cached prefix longer than the new tokens the gathered prefix loads dominate, and 128 new
    tokens per program halve them. The tiles fit in shared memory at every head dim; the CPU's small
    blocks keep the interpreter's tests fast."""
    if device.type == "cpu":
        return ExtendLaunch(32, 16, 4, 1)
    if k_head_dim <= 128:
        return ExtendLaunch(128, 32, 4, 3) if prefix_heavy else ExtendLaunch(64, 32, 4, 3)
    if k_head_dim <= 256:
        return ExtendLaunch(64, 32, 4, 2)
    return ExtendLaunch(32, 32, 4, 1)


def extend_attention(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    out: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    *,
    sm_scale: float,
    page_size: int,
    layout: str = "nhd",
    sliding_window: int | None = None,
    kv_slot_map: torch.Tensor | None = None,
    max_extend_len: int | None = None,
    max_prefix_len: int | None = None,
    launch: ExtendLaunch | None = None,
) -> torch.Tensor:
    """Write attention of the new tokens over prefix + themselves into `out` and return it.

    q_extend [T, Hq, Dk], k_extend [T, Hkv, Dk], v_extend [T, Hkv, Dv], out [T, Hq, Dv];
    k_buffer/v_buffer in `layout`; per-row int tensors [B] on the device. `max_extend_len` is the
    largest `extend_lens` entry, known on the host; it only sizes the grid. `max_prefix_len`
    (host-side too) picks the default launch; `launch` overrides it (the bench's sweep).
    """
    num_tokens, num_q_heads, k_head_dim = q_extend.shape
    num_kv_heads = k_extend.shape[1]
    v_head_dim = v_extend.shape[-1]
    if k_extend.shape[-1] != k_head_dim or k_buffer.shape[-1] != k_head_dim:
        raise ValueError(
            f"q has head dim {k_head_dim}; k_extend has {k_extend.shape[-1]}, k_buffer {k_buffer.shape[-1]}"
        )
    if v_buffer.shape[-1] != v_head_dim:
        raise ValueError(f"v_extend has head dim {v_head_dim} but v_buffer has {v_buffer.shape[-1]}")
    if num_q_heads % num_kv_heads != 0 or {v_extend.shape[1], k_buffer.shape[1], v_buffer.shape[1]} != {
        num_kv_heads
    }:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of one KV head count for every k/v tensor"
        )
    if k_buffer.dtype != v_buffer.dtype or k_extend.dtype != v_extend.dtype:
        raise ValueError(
            f"k and v must share a dtype: buffers {k_buffer.dtype}/{v_buffer.dtype}, "
            f"extend {k_extend.dtype}/{v_extend.dtype}"
        )
    if tuple(out.shape) != (num_tokens, num_q_heads, v_head_dim):
        raise ValueError(f"out must be {(num_tokens, num_q_heads, v_head_dim)}; got {tuple(out.shape)}")
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must be contiguous along the position axis (stride(1) == 1)")
    page, k_strides = pool_strides(k_buffer, layout, page_size)
    _, v_strides = pool_strides(v_buffer, layout, page_size)
    window = window_or_none(sliding_window)
    if max_extend_len is None:
        max_extend_len = num_tokens
    batch_size = extend_lens.shape[0]
    if num_tokens == 0 or batch_size == 0:
        return out

    prefix_heavy = max_prefix_len is not None and max_prefix_len > max_extend_len
    launch = launch or default_extend_launch(k_head_dim, q_extend.device, prefix_heavy)
    block_dk, block_dk_rest = key_dim_blocks(k_head_dim)
    grid = (batch_size, num_q_heads, triton.cdiv(max_extend_len, launch.block_m))
    _extend_kernel[grid](
        q_extend,
        k_extend,
        v_extend,
        out,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        extend_start_loc,
        kv_slot_map if kv_slot_map is not None else req_to_token,
        sm_scale * 1.4426950408889634,
        window,
        *q_extend.stride(),
        *k_extend.stride(),
        *v_extend.stride(),
        *out.stride(),
        *k_strides,
        *v_strides,
        req_to_token.stride(0),
        GROUP=num_q_heads // num_kv_heads,
        PAGE=page,
        HAS_SLOT_MAP=kv_slot_map is not None,
        DK=k_head_dim,
        DV=v_head_dim,
        BLOCK_DK=block_dk,
        BLOCK_DK_REST=block_dk_rest,
        BLOCK_DV=value_dim_block(v_head_dim),
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        PREFIX_DOT_DTYPE=dot_dtype(q_extend.dtype, k_buffer.dtype, q_extend.device),
        EXTEND_DOT_DTYPE=dot_dtype(q_extend.dtype, k_extend.dtype, q_extend.device),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out
