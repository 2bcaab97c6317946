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
from snugkv.memory.kv_pool import DEFAULT_GROUP, KVPool, KVPoolSpec
from snugkv.memory.layout import BufferLayout, KVLayout
from snugkv.memory.moves import KvMoves, PageMoves

SWA_GROUP = "swa"


class SWAKVPool(KVPool):
    def __init__(
        self,
        spec: KVPoolSpec,
        *,
        reserved_tokens: int,
        num_layers: int,
        swa_layer_ids: list[int],
        num_kv_heads: int,
        head_dim: int,
        swa_full_tokens_ratio: float = 0.8,
        v_head_dim: int | None = None,
        arena: KvArena | None = None,
    ) -> None:
        if not 0 < swa_full_tokens_ratio <= 1:
            raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], got {swa_full_tokens_ratio}")
        super().__init__(spec, reserved_tokens=reserved_tokens, arena=arena)
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
                BufferLayout(
                    f"layer{layer}.k", self.dtype, (num_kv_heads, head_dim), self.page_size, self.layout
                )
            )
            groups[group].append(
                BufferLayout(
                    f"layer{layer}.v",
                    self.dtype,
                    (num_kv_heads, self.v_head_dim),
                    self.page_size,
                    self.layout,
                )
            )
        groups[DEFAULT_GROUP].append(
            BufferLayout("full_to_swa.map", torch.int64, (), self.page_size, KVLayout.TOKEN_MAJOR)
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
    def swa_committed_tokens(self) -> int:
        return self.tokens_per_group(self.committed_tokens)[SWA_GROUP]

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

    def slot_map(self, layer_id: int) -> torch.Tensor | None:
        if layer_id not in self.swa_layer_ids:
            return None
        if self.full_to_swa is None:
            raise RuntimeError("the sliding-window pool is closed")
        return self.full_to_swa

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        if v is None:
            raise ValueError("a sliding-window pool stores K and V: pass both")
        slot_map = self.slot_map(layer_id)
        if slot_map is not None:
            loc = slot_map[loc]
        self._store(self.k_buffers[layer_id], loc, k)
        self._store(self.v_buffers[layer_id], loc, v)

    def _moves_by_group(self, moves: KvMoves) -> dict[str, PageMoves]:
        return {DEFAULT_GROUP: moves.full, SWA_GROUP: moves.window}

    def _kv_tensors(self, group: str) -> list[torch.Tensor]:
        layers = [
            layer for layer in range(self.num_layers) if (layer in self.swa_layer_ids) == (group == SWA_GROUP)
        ]
        return [buffer for layer in layers for buffer in (self.k_buffers[layer], self.v_buffers[layer])]

    def _drop_views(self) -> None:
        self.k_buffers.clear()
        self.v_buffers.clear()
        self.full_to_swa = None
