"""The torch reference of rope_store.py: today's q/k norm, RoPE and KV store, op for op.

This module owns the semantics `rope_and_store_kv` must reproduce, and the argument contract both
implementations check. `rope_and_store_kv_reference` is exactly what LlamaAttention / Gemma3Attention
and the attention backend's `set_kv` compute today (layers/norm.py, layers/rotary.py,
attention/triton_store.py), except that its results land in qkv in place like the kernel's: CPU
float32 outputs are bit-identical to the layers. Must never import from snugkv outside this package.
"""

from __future__ import annotations

import torch

from snugkv.kernels.kv_store import store_kv_reference
from snugkv.kernels.norm import rms_norm_reference


def split_qkv(
    qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q `[T, Hq, D]`, k and v `[T, Hkv, D]`: views of the merged projection, no copies."""
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    # split_with_sizes and view: the C methods under `split` and `unflatten`, without their Python
    # wrappers (this runs in every layer of every CPU step).
    q, k, v = qkv.split_with_sizes([q_size, kv_size, kv_size], dim=-1)
    rows = qkv.shape[:-1]
    return (
        q.view(*rows, num_q_heads, head_dim),
        k.view(*rows, num_kv_heads, head_dim),
        v.view(*rows, num_kv_heads, head_dim),
    )


def rotate_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, neox_style: bool
) -> torch.Tensor:
    """layers/rotary.RotaryEmbedding._rotate: cos/sin `[T, 1, rotary_dim // 2]`, x `[T, H, D]`."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if neox_style:
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if rest.shape[-1] == 0:
        return rotated
    return torch.cat((rotated, rest), dim=-1)


def check_rope_args(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    gemma_norm: bool,
) -> int:
    """Validates the shapes; returns rotary_dim (twice the cos cache's width)."""
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv must be [T, {width}] ((Hq + 2 * Hkv) * D) with a contiguous last dim; "
            f"got shape {tuple(qkv.shape)} strides {qkv.stride()}"
        )
    num_tokens = qkv.shape[0]
    if positions.shape != (num_tokens,) or out_cache_loc.shape != (num_tokens,):
        raise ValueError(
            f"positions {tuple(positions.shape)} and out_cache_loc {tuple(out_cache_loc.shape)} "
            f"must both be [{num_tokens}]"
        )
    rotary_dim = 2 * cos_cache.shape[-1]
    if cos_cache.dim() != 2 or sin_cache.shape != cos_cache.shape or rotary_dim > head_dim:
        raise ValueError(
            f"cos/sin caches must be [max_position, rotary_dim // 2] with rotary_dim <= {head_dim}; "
            f"got {tuple(cos_cache.shape)} and {tuple(sin_cache.shape)}"
        )
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("qk-norm needs both q_norm_weight and k_norm_weight (or neither)")
    if q_norm_weight is not None and k_norm_weight is not None:
        if q_norm_weight.shape != (head_dim,) or k_norm_weight.shape != (head_dim,):
            raise ValueError(f"qk-norm weights must be [{head_dim}]")
        if q_norm_weight.dtype != k_norm_weight.dtype:
            raise ValueError(
                f"qk-norm weights differ in dtype: {q_norm_weight.dtype} vs {k_norm_weight.dtype}"
            )
        # Llama's norm output takes the promoted dtype; the kernel keeps qkv's, so they must agree.
        if not gemma_norm and torch.promote_types(q_norm_weight.dtype, qkv.dtype) != qkv.dtype:
            raise ValueError(
                f"qk-norm weights ({q_norm_weight.dtype}) must not promote qkv ({qkv.dtype}): "
                "cast them to qkv's dtype"
            )
    return rotary_dim


def rope_and_store_kv_reference(
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
    """The layers' ops as they run today (q_norm/k_norm, RotaryEmbedding, store_kv), written into qkv."""
    rotary_dim = check_rope_args(
        qkv, positions, cos_cache, sin_cache, out_cache_loc, num_q_heads, num_kv_heads, head_dim,
        q_norm_weight, k_norm_weight, gemma_norm,
    )  # fmt: skip
    q, k, v = split_qkv(qkv, num_q_heads, num_kv_heads, head_dim)
    cos, sin = (
        cos_cache.index_select(0, positions).unsqueeze(1),
        sin_cache.index_select(0, positions).unsqueeze(1),
    )
    if q_norm_weight is not None and k_norm_weight is not None:
        new_q = rms_norm_reference(q, q_norm_weight, norm_eps, gemma=gemma_norm)
        new_k = rms_norm_reference(k, k_norm_weight, norm_eps, gemma=gemma_norm)
        new_q = rotate_reference(new_q, cos, sin, rotary_dim, neox_style)
        new_k = rotate_reference(new_k, cos, sin, rotary_dim, neox_style)
        q.copy_(new_q)
        k.copy_(new_k)
    else:
        # q's and k's heads lie side by side in qkv and RoPE treats every head alike: rotating
        # them as one tensor gives the same values as two calls, at half the ops (CPU runs this).
        qk = qkv[:, : (num_q_heads + num_kv_heads) * head_dim].unflatten(
            -1, (num_q_heads + num_kv_heads, head_dim)
        )
        qk.copy_(rotate_reference(qk, cos, sin, rotary_dim, neox_style))
    store_kv_reference(
        k_buffer,
        v_buffer,
        out_cache_loc,
        k,
        v,
        page_size=page_size,
        layout=layout,
        kv_slot_map=kv_slot_map,
    )
    return q, k, v
