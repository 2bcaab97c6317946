"""The attention backend interface: one small ABC every backend (torch, Triton) implements.

Contract of `forward(q, k, v, layer, forward_batch)`:
- Inputs are the new tokens of the batch, concatenated row-major (docs/ARCHITECTURE.md):
  q `[T, layer.num_heads, layer.head_dim]`, k `[T, layer.num_kv_heads, layer.head_dim]`,
  v `[T, layer.num_kv_heads, layer.v_head_dim]`, all in the compute dtype.
- The backend first writes k/v into the pool: `kv_pool.set_kv(layer.layer_id, out_cache_loc, k, v)`
  (the pool casts to its storage dtype). `k is None` means the layer's K/V were written already.
- Then the new token j of row i, at position `qp = prefix_lens[i] + j`, attends to every key
  position `kp` of `req_to_token[req_pool_indices[i], :seq_lens[i]]` with `kp <= qp` and, for a
  sliding-window layer, `qp - kp < layer.sliding_window`; scores are scaled by `layer.scaling`;
  query head h uses KV head `h // (num_heads // num_kv_heads)` (GQA).
- It returns `[T, layer.num_heads, layer.v_head_dim]` in q's dtype. KV read from an fp8 pool is
  upcast; accumulation is at least fp32.
- A backend reads slots through `pool.translate_loc(layer_id, slots)` when the pool has it
  (SWA sub-pools), and KV buffers in the pool's layout (`pool.layout`, `pool.page_size`).

`init_forward_metadata(forward_batch)` runs once per forward, before the first layer; a backend
may put shared per-batch state into `forward_batch.attn_metadata`. For a DECODE batch captured in
a CUDA graph it runs inside the capture: device ops only, no host sync, shapes that depend only
on the batch size and `forward_batch.kv_width` (CPU length mirrors are None there).

A backend never allocates slots, never writes the request-to-token table and never frees.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from snugkv.layers.attention import PagedAttention
    from snugkv.runner.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    name: str = "abstract"

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Per-batch preparation shared by all layers (default: nothing)."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: PagedAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """Write the new K/V, attend, return `[T, num_heads, v_head_dim]` (see the module docstring)."""
