"""Hybrid sliding-window pool: full-attention layers and window layers in two sub-pools.

Window layers only ever need the last `window` tokens of each request, so their sub-pool is
smaller: it holds `swa_full_tokens_ratio` times the full sub-pool's tokens. The allocator gives
every token a full-pool slot and, while it is inside the window, a window-pool slot; the
`full_to_swa` table (one int64 per full slot, in the arena so its address is fixed for graphs)
maps the first to the second. Callers always pass full-pool slots; this pool translates.
"""

from __future__ import annotations

import torch

from snugkv.memory.arena import KvArena
from snugkv.memory.kv_pool import DEFAULT_GROUP, KVPool, PoolMode
from snugkv.memory.layout import BufferLayout, KVLayout
from snugkv.memory.vmm import VirtualMemory

SWA_GROUP = "swa"


class SWAKVPool(KVPool):
    def __init__(
        self,
        *,
        num_layers: int,
        swa_layer_ids: list[int],
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str,
        page_size: int,
        layout: KVLayout | str,
        max_num_tokens: int,
        device: torch.device | str,
        swa_full_tokens_ratio: float = 0.8,
        mode: PoolMode | str = PoolMode.STATIC,
        arena: KvArena | None = None,
        v_head_dim: int | None = None,
        memory: VirtualMemory | None = None,
    ) -> None:
        if not 0 < swa_full_tokens_ratio <= 1:
            raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], got {swa_full_tokens_ratio}")
        super().__init__(
            dtype=dtype,
            page_size=page_size,
            layout=layout,
            max_num_tokens=max_num_tokens,
            device=device,
            mode=mode,
            arena=arena,
            memory=memory,
        )
        self.swa_full_tokens_ratio = swa_full_tokens_ratio
        self.num_layers = num_layers
        self.swa_layer_ids = frozenset(swa_layer_ids)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        groups: dict[str, list[BufferLayout]] = {DEFAULT_GROUP: [], SWA_GROUP: []}
        for layer in range(num_layers):
            group = SWA_GROUP if layer in self.swa_layer_ids else DEFAULT_GROUP
            groups[group].append(
                BufferLayout(f"layer{layer}.k", self.dtype, (num_kv_heads, head_dim), page_size, self.layout)
            )
            groups[group].append(
                BufferLayout(
                    f"layer{layer}.v", self.dtype, (num_kv_heads, self.v_head_dim), page_size, self.layout
                )
            )
        groups[DEFAULT_GROUP].append(
            BufferLayout("full_to_swa.map", torch.int64, (), page_size, KVLayout.TOKEN_MAJOR)
        )
        self.full_to_swa: torch.Tensor | None = None
        views = self._place(groups)
        self.k_buffers = {layer: views[f"layer{layer}.k"] for layer in range(num_layers)}
        self.v_buffers = {layer: views[f"layer{layer}.v"] for layer in range(num_layers)}
        self.full_to_swa = views["full_to_swa.map"]
        if self.committed_bytes:  # static mode backed it inside _place
            self._reset_dummy_mapping()

    def tokens_per_group(self, num_tokens: int) -> dict[str, int]:
        swa_tokens = int(num_tokens * self.swa_full_tokens_ratio) // self.page_size * self.page_size
        return {DEFAULT_GROUP: num_tokens, SWA_GROUP: swa_tokens}

    @property
    def swa_capacity_tokens(self) -> int:
        return self.tokens_per_group(self.capacity_tokens)[SWA_GROUP]

    def ensure_prefix(self) -> None:
        super().ensure_prefix()
        self._reset_dummy_mapping()

    def _back(self, num_tokens: int) -> None:
        super()._back(num_tokens)
        self._reset_dummy_mapping()

    def _reset_dummy_mapping(self) -> None:
        # Dummy-page slots map to themselves so padded rows read and write window page 0.
        if self.full_to_swa is not None:
            self.full_to_swa[: self.page_size].copy_(torch.arange(self.page_size, device=self.device))

    def is_swa_layer(self, layer_id: int) -> bool:
        return layer_id in self.swa_layer_ids

    def translate_loc(self, layer_id: int, loc: torch.Tensor) -> torch.Tensor:
        assert self.full_to_swa is not None, "pool is closed"
        return self.full_to_swa[loc] if layer_id in self.swa_layer_ids else loc

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        loc = self.translate_loc(layer_id, loc)
        self._store(self.k_buffers[layer_id], loc, k)
        self._store(self.v_buffers[layer_id], loc, v)

    def _drop_views(self) -> None:
        self.k_buffers.clear()
        self.v_buffers.clear()
        self.full_to_swa = None
