"""The attention op of one layer: what a backend needs to know about it, and the call into it.

Models build one `PagedAttention` per layer and call it with projected, rotated q/k/v. The op
owns no weights; it forwards to `forward_batch.attn_backend`, which writes the new K/V into the
KV pool and attends over each request's cached tokens (see `snugkv.core.forward`).
"""

from __future__ import annotations

import torch
from torch import nn

from snugkv.core.forward import ForwardBatch
from snugkv.kernels import rope_and_store_kv
from snugkv.layers.norm import RMSNorm
from snugkv.layers.rotary import RotaryEmbedding


class PagedAttention(nn.Module):
    """Per-layer attention descriptor.

    `sliding_window` is the number of key positions a query sees including itself (None: all).
    `v_head_dim` differs from `head_dim` only for latent attention (MLA).
    """

    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        scaling: float | None = None,
        sliding_window: int | None = None,
        v_head_dim: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.scaling = head_dim**-0.5 if scaling is None else scaling
        self.sliding_window = sliding_window

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """q `[T, Hq, D]`, k `[T, Hkv, D]`, v `[T, Hkv, Dv]` -> `[T, Hq, Dv]`."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)

    def forward_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        forward_batch: ForwardBatch,
        *,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """Merged qkv `[T, (Hq + 2 Hkv) * D]` -> `[T, Hq, Dv]`: per-head q/k norms (if given) and
        RoPE applied to qkv in place, K/V written into the pool, then attention."""
        pool = forward_batch.kv_pool
        k_buffer, v_buffer = pool.get_kv_buffer(self.layer_id)
        q, k, v = rope_and_store_kv(
            qkv,
            positions,
            rotary.cos_cache,
            rotary.sin_cache,
            k_buffer,
            v_buffer,
            forward_batch.out_cache_loc,
            num_q_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            page_size=pool.page_size,
            layout=str(pool.layout),
            neox_style=rotary.neox_style,
            q_norm_weight=None if q_norm is None else q_norm.weight,
            k_norm_weight=None if k_norm is None else k_norm.weight,
            norm_eps=1e-6 if q_norm is None else q_norm.eps,
            gemma_norm=q_norm is not None and q_norm.gemma,
            kv_slot_map=pool.slot_map(self.layer_id),
        )
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv=False)

    def extra_repr(self) -> str:
        window = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        return (
            f"layer_id={self.layer_id}, heads={self.num_heads}/{self.num_kv_heads}, "
            f"head_dim={self.head_dim}{window}"
        )
