"""One launch per attention layer from the merged qkv projection to the KV pool: qk-norm, RoPE, store.

`rope_and_store_kv` takes the qkv projection `[T, (Hq + 2 * Hkv) * D]` (row-major q | k | v heads)
and, in one Triton launch with grid `(T, Hq + 2 * Hkv)` (one program per token and head):
1. q and k heads: optionally a per-head RMSNorm over all D dims (Qwen3's qk-norm, or Gemma's with
   `gemma_norm`), then rotary embedding of the first `rotary_dim` dims (neox: rotate the two halves;
   GPT-J: rotate interleaved pairs) from float32 cos/sin caches `[max_position, rotary_dim // 2]`
   gathered at `positions`; the rest of the head passes through.
2. The results are written back INTO qkv (the q and k heads change in place; v never does). qkv is
   the projection's fresh output that nothing else reads, so this allocates nothing and leaves q as
   a strided `[T, Hq, D]` view that the attention kernels already take.
3. k heads (rotated) and v heads are written into the pool buffers at `out_cache_loc` (through
   `kv_slot_map` if given), cast to the buffer dtype (kernels/kv_store.py owns addressing and cast).

Numerics mirror layers/norm.py and layers/rotary.py op for op, in the compute dtype: the norm
rounds where RMSNorm rounds, cos/sin are cast to the compute dtype before the products, and each
product, difference and sum is rounded as torch rounds its separate elementwise ops. Without
qk-norm a 16-bit result is therefore the torch result bit for bit; with it, only the float32 sum of
squares may differ in its last bit. The torch reference is the layers' code as it runs today.

Graph-safe: grid depends only on T and the head counts, positions and slots are read on the device.
The torch reference lives in rope_reference.py. Must never import from snugkv outside this
package (kernels sit at the bottom of the import graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from snugkv.kernels.device import runs_triton
from snugkv.kernels.kv_store import load_slot, pool_strides, store_head, triton_stores_to
from snugkv.kernels.rope_reference import check_rope_args, rope_and_store_kv_reference, split_qkv


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """Round a float32 value to the compute dtype and back: where torch would store an intermediate."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _head_norm(x, Weights, mask, rstd, GEMMA: tl.constexpr, DTYPE: tl.constexpr):
    w = tl.load(Weights, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        return _round(x * rstd * (1.0 + w), DTYPE)
    return _round(_round(x * rstd, DTYPE) * w, DTYPE)


@triton.jit
def _rope_and_store_kv_kernel(
    Qkv,
    Positions,
    Cos,
    Sin,
    QNormW,
    KNormW,
    Loc,
    Slot_map,
    KBuf,
    VBuf,
    stride_qkv_token,
    stride_cos_pos,
    stride_sin_pos,
    kb_page,
    kb_head,
    kb_off,
    kb_dim,
    vb_page,
    vb_head,
    vb_off,
    vb_dim,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    NEOX: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
    GEMMA_NORM: tl.constexpr,
    HAS_SLOT_MAP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = Qkv + token * stride_qkv_token + head * HEAD_DIM
    DTYPE = Qkv.dtype.element_ty
    dims = tl.arange(0, BLOCK_D)
    if head >= NUM_Q_HEADS + NUM_KV_HEADS:  # a value head goes to the pool untouched
        in_head = dims < HEAD_DIM
        v = tl.load(row + dims, mask=in_head, other=0.0).to(tl.float32)
        slot = load_slot(Loc, token, Slot_map, HAS_SLOT_MAP)
        v_head = head - NUM_Q_HEADS - NUM_KV_HEADS
        store_head(VBuf, slot, v_head, dims, v, in_head, vb_page, vb_head, vb_off, vb_dim, PAGE)
    else:
        half = tl.arange(0, BLOCK_HALF)
        in_half = half < ROTARY_DIM // 2
        if NEOX:
            first = half
            second = half + ROTARY_DIM // 2
        else:
            first = 2 * half
            second = 2 * half + 1
        in_rest = (dims >= ROTARY_DIM) & (dims < HEAD_DIM)
        x1 = tl.load(row + first, mask=in_half, other=0.0).to(tl.float32)
        x2 = tl.load(row + second, mask=in_half, other=0.0).to(tl.float32)
        rest = tl.load(row + dims, mask=in_rest, other=0.0).to(tl.float32)
        if HAS_QK_NORM:
            # first, second and rest cover the head exactly once: their squares sum to the row's.
            squares = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0) + tl.sum(rest * rest, axis=0)
            rstd = tl.rsqrt(squares / HEAD_DIM + eps)
            is_key = head >= NUM_Q_HEADS
            w1 = tl.where(is_key, KNormW + first, QNormW + first)
            w2 = tl.where(is_key, KNormW + second, QNormW + second)
            w_rest = tl.where(is_key, KNormW + dims, QNormW + dims)
            x1 = _head_norm(x1, w1, in_half, rstd, GEMMA_NORM, DTYPE)
            x2 = _head_norm(x2, w2, in_half, rstd, GEMMA_NORM, DTYPE)
            rest = _head_norm(rest, w_rest, in_rest, rstd, GEMMA_NORM, DTYPE)
            tl.store(row + dims, rest.to(DTYPE), mask=in_rest)
        position = tl.load(Positions + token).to(tl.int64)
        cos = _round(tl.load(Cos + position * stride_cos_pos + half, mask=in_half, other=0.0), DTYPE)
        sin = _round(tl.load(Sin + position * stride_sin_pos + half, mask=in_half, other=0.0), DTYPE)
        out1 = _round(_round(x1 * cos, DTYPE) - _round(x2 * sin, DTYPE), DTYPE)
        out2 = _round(_round(x2 * cos, DTYPE) + _round(x1 * sin, DTYPE), DTYPE)
        tl.store(row + first, out1.to(DTYPE), mask=in_half)
        tl.store(row + second, out2.to(DTYPE), mask=in_half)
        if head >= NUM_Q_HEADS:
            slot = load_slot(Loc, token, Slot_map, HAS_SLOT_MAP)
            k_head = head - NUM_Q_HEADS
            store_head(KBuf, slot, k_head, first, out1, in_half, kb_page, kb_head, kb_off, kb_dim, PAGE)
            store_head(KBuf, slot, k_head, second, out2, in_half, kb_page, kb_head, kb_off, kb_dim, PAGE)
            store_head(KBuf, slot, k_head, dims, rest, in_rest, kb_page, kb_head, kb_off, kb_dim, PAGE)


def rope_and_store_kv_triton(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    layout: str = "nhd",
    neox_style: bool = True,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    gemma_norm: bool = False,
    kv_slot_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rotary_dim = check_rope_args(
        qkv, positions, cos_cache, sin_cache, out_cache_loc, num_q_heads, num_kv_heads, head_dim,
        q_norm_weight, k_norm_weight, gemma_norm,
    )  # fmt: skip
    if cos_cache.stride(1) != 1 or sin_cache.stride(1) != 1:
        raise ValueError("cos/sin caches need a contiguous last dim")
    page, k_strides = pool_strides(k_buffer, layout, page_size)
    _, v_strides = pool_strides(v_buffer, layout, page_size)
    for name, buffer in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if buffer.shape[1] != num_kv_heads or buffer.shape[-1] != head_dim:
            raise ValueError(
                f"{name} {tuple(buffer.shape)} does not hold {num_kv_heads} heads of dim {head_dim}"
            )
    has_norm = q_norm_weight is not None
    num_tokens = qkv.shape[0]
    if num_tokens > 0:
        _rope_and_store_kv_kernel[(num_tokens, num_q_heads + 2 * num_kv_heads)](
            qkv,
            positions,
            cos_cache,
            sin_cache,
            q_norm_weight if has_norm else cos_cache,
            k_norm_weight if has_norm else cos_cache,
            out_cache_loc,
            kv_slot_map if kv_slot_map is not None else out_cache_loc,
            k_buffer,
            v_buffer,
            qkv.stride(0),
            cos_cache.stride(0),
            sin_cache.stride(0),
            *k_strides,
            *v_strides,
            norm_eps,
            NUM_Q_HEADS=num_q_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            ROTARY_DIM=rotary_dim,
            NEOX=neox_style,
            HAS_QK_NORM=has_norm,
            GEMMA_NORM=gemma_norm,
            HAS_SLOT_MAP=kv_slot_map is not None,
            PAGE=page,
            BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_HALF=triton.next_power_of_2(max(rotary_dim // 2, 1)),
            num_warps=1 if head_dim <= 256 else 4,
            enable_fp_fusion=False,  # a fused multiply-add would skip the rounding torch does between ops
        )
    return split_qkv(qkv, num_q_heads, num_kv_heads, head_dim)


def rope_and_store_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    layout: str = "nhd",
    neox_style: bool = True,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    gemma_norm: bool = False,
    kv_slot_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qk-norm (if weights are given) + RoPE on qkv's q and k heads IN PLACE, then k and v into the pool.

    qkv `[T, (Hq + 2 * Hkv) * D]`; positions and out_cache_loc `[T]` (int); cos/sin caches float32
    `[max_position, rotary_dim // 2]` (RotaryEmbedding.cos_cache / sin_cache). Returns the views
    q `[T, Hq, D]`, k and v `[T, Hkv, D]` of qkv after the update.
    """
    kwargs = dict(
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
        layout=layout, neox_style=neox_style, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight,
        norm_eps=norm_eps, gemma_norm=gemma_norm, kv_slot_map=kv_slot_map,
    )  # fmt: skip
    args = (qkv, positions, cos_cache, sin_cache, k_buffer, v_buffer, out_cache_loc)
    if runs_triton(qkv) and triton_stores_to(k_buffer):
        return rope_and_store_kv_triton(*args, **kwargs)  # type: ignore[arg-type]
    return rope_and_store_kv_reference(*args, **kwargs)  # type: ignore[arg-type]
