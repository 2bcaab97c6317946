"""What the Triton attention kernels share: slot addressing, head-dim blocking, operand types, and
the inner step of every attention loop (one block of keys scored, folded into an online softmax).

Layouts (docs/ARCHITECTURE.md). Slot `s` is read at
`(s // PAGE) * stride_page + head * stride_head + (s % PAGE) * stride_off + d * stride_dim`:
token-major "nhd" `[slots, Hkv, D]` runs with PAGE = 1 and stride_off = 0, page-major "hnd"
`[pages, Hkv, P, D]` with PAGE = P. Key head dims are covered by a power-of-two block plus a
masked remainder block; softmax runs in base 2 with fp32 state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Stands in for "no sliding window": larger than any context, small enough that
# `position - NO_WINDOW` cannot overflow int32.
NO_WINDOW = 1 << 30


def key_dim_blocks(head_dim: int) -> tuple[int, int]:
    """Split a key head dim into a power-of-two block and a (masked) remainder block, 0 if none.

    tl.dot needs every dimension >= 16, hence the floor on both blocks.
    """
    main = 1 << (head_dim.bit_length() - 1)
    if main < 16:
        return 16, 0
    rest = head_dim - main
    return main, 0 if rest == 0 else max(16, triton.next_power_of_2(rest))


def value_dim_block(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def dot_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device) -> tl.dtype:
    """The operand type of the kernels' matrix products; accumulation is always fp32.

    16-bit queries meet keys of their own type on the tensor cores; fp8 keys and values upcast
    exactly to fp16 (a native conversion on the GPU, where fp8 to bf16 is not), and bf16 queries
    are rounded to fp16 for the product (more mantissa, enough range for attention queries).
    Every other mix runs in fp32 with IEEE products so nothing is silently rounded to TF32.
    The Triton CPU interpreter (triton 3.9) computes bf16 products wrongly, so it gets fp32.
    """
    low_precision = q_dtype in (torch.float16, torch.bfloat16) and (
        kv_dtype == q_dtype or kv_dtype == torch.float8_e4m3fn
    )
    if not low_precision or (device.type == "cpu" and q_dtype == torch.bfloat16):
        return tl.float32
    if kv_dtype == torch.float8_e4m3fn:
        return tl.float16
    return tl.float16 if q_dtype == torch.float16 else tl.bfloat16


def window_or_none(sliding_window: int | None) -> int:
    if sliding_window is None:
        return NO_WINDOW
    if sliding_window < 1:
        raise ValueError(
            f"sliding_window counts positions including the query, so it must be >= 1; got {sliding_window}"
        )
    return sliding_window


@triton.jit
def load_slots(Req_to_token, row_offset, positions, mask, Slot_map, HAS_SLOT_MAP: tl.constexpr):
    """Table lookup for a block of key positions, through the window sub-pool map if there is one."""
    slots = tl.load(Req_to_token + row_offset + positions, mask=mask, other=0).to(tl.int64)
    if HAS_SLOT_MAP:
        slots = tl.load(Slot_map + slots, mask=mask, other=0).to(tl.int64)
    return slots


@triton.jit
def slot_offsets(slots, head, stride_page, stride_head, stride_off, PAGE: tl.constexpr):
    return (slots // PAGE) * stride_page + head * stride_head + (slots % PAGE) * stride_off


@triton.jit
def block_scores(
    q,
    q_rest,
    K,
    k_rows,
    key_mask,
    dk,
    dk_rest,
    stride_k_dim,
    DK: tl.constexpr,
    BLOCK_DK_REST: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Raw scores `[rows, BLOCK_N]` of queries `q` (and the remainder block `q_rest`, when the key
    dim has one) against the keys at element offsets `k_rows` of `K`; masked keys load as 0."""
    k = tl.load(
        K + k_rows[None, :] + dk[:, None] * stride_k_dim,
        mask=key_mask[None, :] & (dk[:, None] < DK),
        other=0.0,
    )
    qk = tl.dot(q, k.to(DOT_DTYPE), input_precision="ieee")
    if BLOCK_DK_REST > 0:
        k_rest = tl.load(
            K + k_rows[None, :] + dk_rest[:, None] * stride_k_dim,
            mask=key_mask[None, :] & (dk_rest[:, None] < DK),
            other=0.0,
        )
        qk += tl.dot(q_rest, k_rest.to(DOT_DTYPE), input_precision="ieee")
    return qk


@triton.jit
def block_values(V, v_rows, key_mask, dv, stride_v_dim, DV: tl.constexpr):
    """Values `[BLOCK_N, BLOCK_DV]` at element offsets `v_rows` of `V`; masked keys load as 0."""
    return tl.load(
        V + v_rows[:, None] + dv[None, :] * stride_v_dim,
        mask=key_mask[:, None] & (dv[None, :] < DV),
        other=0.0,
    )


@triton.jit
def online_softmax_step(qk, v, m_i, l_i, acc, DOT_DTYPE: tl.constexpr):
    """Fold one block of base-2 scores (-inf where masked) and its values into the running state."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row may see no key in this block (window, causal edge or padding rows): keep it NaN-free.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision="ieee")
    return m_new, l_i, acc
