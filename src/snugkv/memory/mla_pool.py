"""MLA pool: one compressed latent buffer per layer (DeepSeek-V2 style attention).

Each slot holds `kv_lora_rank + qk_rope_head_dim` values: the compressed KV latent followed by
the shared rotary key. Attention reads K as the whole row and V as its first `kv_lora_rank`
columns, so `get_kv_buffer` returns the buffer and a strided view of it.
"""

from __future__ import annotations

import torch

from snugkv.memory.arena import KvArena
from snugkv.memory.kv_pool import DEFAULT_GROUP, KVPool, KVPoolSpec
from snugkv.memory.layout import BufferLayout


class MLAKVPool(KVPool):
    def __init__(
        self,
        spec: KVPoolSpec,
        *,
        reserved_tokens: int,
        num_layers: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        arena: KvArena | None = None,
    ) -> None:
        super().__init__(spec, reserved_tokens=reserved_tokens, arena=arena)
        self.num_layers = num_layers
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        latent_dim = kv_lora_rank + qk_rope_head_dim
        layouts = [
            BufferLayout(f"layer{layer}.latent", self.dtype, (1, latent_dim), self.page_size, self.layout)
            for layer in range(num_layers)
        ]
        views = self._place({DEFAULT_GROUP: layouts})
        self.latent_buffers = [views[f"layer{layer}.latent"] for layer in range(num_layers)]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        latent = self.latent_buffers[layer_id]
        return latent, latent[..., : self.kv_lora_rank]

    def set_kv(
        self, layer_id: int, loc: torch.Tensor, latent: torch.Tensor, v: torch.Tensor | None = None
    ) -> None:
        """Write `latent [n, 1, kv_lora_rank + rope]`; V is part of the latent, so `v` is ignored."""
        self._store(self.latent_buffers[layer_id], loc, latent)

    def _kv_tensors(self, group: str) -> list[torch.Tensor]:
        return list(self.latent_buffers)

    def _drop_views(self) -> None:
        self.latent_buffers.clear()
