"""KV pools: the buffers that hold K/V per slot, laid out in a `KvArena`.

A pool is created in one of two modes:
- `post-capture`: buffers are virtual addresses only, sized for an upper bound of tokens.
  `ensure_prefix()` backs the dummy page before graph capture; `finalize_backing(n)` backs
  exactly what n tokens need once sizing has measured free memory.
- `static`: every byte is backed at creation (the classic approach, and the fallback).

A pool owns where KV lives; it never decides how many tokens fit (sizing does) nor which
slots are used (allocators do). Subclasses describe their buffers as `BufferLayout`s in
token groups (SWA has two: full and window); everything else is shared here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum

import torch

from snugkv.memory.arena import ArenaBuffer, KvArena, auto_chunk_bytes
from snugkv.memory.layout import BufferLayout, KVLayout, parse_kv_dtype
from snugkv.memory.moves import KvMoves, PageMoves
from snugkv.memory.views import widest_words
from snugkv.memory.vmm import GIB, VirtualMemory
from snugkv.memory.vmm_factory import create_vmm
from snugkv.memory.vmm_plain import PlainMemory

logger = logging.getLogger(__name__)

DEFAULT_GROUP = "full"
DRAFT_BUFFER_PREFIX = "draft"  # a separate draft model's layer buffers: draft0.kv, draft1.kv, ...
MOVE_STAGING_BYTES = 16 << 20  # a shrink's page copy goes through at most this much at a time


class PoolMode(StrEnum):
    POST_CAPTURE = "post-capture"
    STATIC = "static"


@dataclass(frozen=True, slots=True)
class KVPoolSpec:
    """How a pool stores KV, whatever its kind: storage dtype, page size, layout, device, whether it
    is backed now (static) or after graph capture (post-capture), the memory backend (None: the
    device's default, see `_default_memory`) and the largest extension its arena commits
    (`KvArena.chunk_bytes`: what a later shrink drops whole; None: `arena.auto_chunk_bytes` for the
    pool's number of buffers, so a shrink keeps at most 512 MiB more than asked)."""

    dtype: torch.dtype
    page_size: int
    layout: KVLayout
    device: torch.device
    mode: PoolMode = PoolMode.STATIC
    memory: VirtualMemory | None = None
    chunk_bytes: int | None = None

    @classmethod
    def of(
        cls,
        *,
        dtype: torch.dtype | str,
        page_size: int,
        layout: KVLayout | str,
        device: torch.device | str,
        mode: PoolMode | str = PoolMode.STATIC,
        memory: VirtualMemory | None = None,
        chunk_bytes: int | None = None,
    ) -> KVPoolSpec:
        """A spec from user-facing names ("bfloat16", "hnd", "post-capture"), checked."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        return cls(
            parse_kv_dtype(dtype),
            page_size,
            KVLayout(layout),
            torch.device(device),
            PoolMode(mode),
            memory,
            chunk_bytes,
        )


class KVPool:
    """Shared machinery of every pool: placement, views, backing, byte math.

    Token counts: `reserved_tokens` is the upper bound the address space was laid out for;
    `committed_tokens` is what is backed by physical memory now (both page multiples, not
    counting the dummy page). Subclasses call `_place(layouts_by_group)` from their constructor
    and may override `tokens_per_group` when groups hold different token counts.
    """

    def __init__(self, spec: KVPoolSpec, *, reserved_tokens: int, arena: KvArena | None) -> None:
        if reserved_tokens < spec.page_size:
            raise ValueError(f"reserved_tokens={reserved_tokens} is below one page ({spec.page_size} tokens)")
        self.spec = spec
        self.reserved_tokens = reserved_tokens // spec.page_size * spec.page_size
        self._arena = arena
        self.owns_arena = arena is None  # made here, so `close` releases it too
        self._buffers: dict[str, list[ArenaBuffer]] = {}
        self.committed_tokens = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    @property
    def layout(self) -> KVLayout:
        return self.spec.layout

    @property
    def device(self) -> torch.device:
        return self.spec.device

    @property
    def mode(self) -> PoolMode:
        return self.spec.mode

    # -- construction -------------------------------------------------------------------
    def _place(self, layouts_by_group: dict[str, list[BufferLayout]]) -> dict[str, torch.Tensor]:
        """Lay the buffers out in the arena (made here if none was given) and return views."""
        upper = self.tokens_per_group(self.reserved_tokens)
        if self._arena is None:
            vmm = self.spec.memory or self._default_memory()
            need = sum(
                vmm.align_up(layout.bytes_for_tokens(upper[group]))
                for group, layouts in layouts_by_group.items()
                for layout in layouts
            )
            count = sum(len(layouts) for layouts in layouts_by_group.values())
            chunk = self.spec.chunk_bytes or auto_chunk_bytes(count, vmm.granularity_bytes, need)
            self._arena = KvArena(vmm, need, label=type(self).__name__, chunk_bytes=chunk)
        views: dict[str, torch.Tensor] = {}
        for group, layouts in layouts_by_group.items():
            placed = [self._arena.add_buffer(layout, upper[group]) for layout in layouts]
            self._buffers[group] = placed
            views.update({buffer.name: self._arena.view(buffer) for buffer in placed})
        if self.mode is PoolMode.STATIC:
            self._back(self.reserved_tokens)
            self._log("KV Cache is allocated.")
        else:
            self._log("KV Cache VA upper bound.")
        return views

    def _default_memory(self) -> VirtualMemory:
        """Static pools on a GPU take plain allocations (as classic engines do, and where VMM is
        missing); post-capture pools and every CPU pool use the device's VMM backend."""
        if self.mode is PoolMode.STATIC and self.device.type == "cuda":
            return PlainMemory(self.device)
        return create_vmm(self.device)

    def _log(self, prefix: str) -> None:
        tokens = self.tokens_per_group(self.reserved_tokens)
        for group, buffers in self._buffers.items():
            sizes: dict[str, int] = {}
            for buffer in buffers:
                kind = buffer.name.split(".")[-1]
                sizes[kind] = sizes.get(kind, 0) + buffer.layout.bytes_for_tokens(tokens[group])
            sized = ", ".join(f"{kind.upper()} size: {size / GIB:.2f} GB" for kind, size in sizes.items())
            where = f" [{group}]" if len(self._buffers) > 1 else ""
            logger.info("%s%s dtype: %s, #tokens: %d, %s", prefix, where, self.dtype, tokens[group], sized)

    # -- byte math ----------------------------------------------------------------------
    def tokens_per_group(self, num_tokens: int) -> dict[str, int]:
        """Usable tokens each buffer group holds when the pool holds `num_tokens`."""
        return {DEFAULT_GROUP: num_tokens}

    def bytes_for_tokens(self, num_tokens: int) -> int:
        """Bytes the backend commits (granule-aligned per buffer) for `num_tokens`."""
        return sum(self._targets(num_tokens).values())

    def _targets(self, num_tokens: int) -> dict[str, int]:
        arena = self.arena
        tokens = self.tokens_per_group(num_tokens)
        return {
            buffer.name: arena.vmm.align_up(buffer.layout.bytes_for_tokens(tokens[group]))
            for group, buffers in self._buffers.items()
            for buffer in buffers
        }

    @property
    def bytes_per_token(self) -> float:
        """Average bytes one more token costs across all buffers (sub-pools in their ratio)."""
        probe = self.page_size * 1_000_000
        return sum(
            buffer.layout.slot_bytes * tokens / probe
            for group, tokens in self.tokens_per_group(probe).items()
            for buffer in self._buffers[group]
        )

    def backing_bytes(self, num_tokens: int) -> int:
        """Bytes the pool holds committed once resized to `num_tokens`: a grow backs what the tokens
        need (granule-aligned per buffer), a shrink keeps each buffer's extension the new end falls
        in whole (`KvArena.backing_bytes`). Sizing fits this, so a shrink sized from a budget
        releases at least what the budget asks."""
        arena = self.arena
        return sum(arena.backing_bytes(name, size) for name, size in self._targets(num_tokens).items())

    def max_tokens_within(self, budget_bytes: int, at_most_tokens: int | None = None) -> int:
        """The most tokens (a page multiple, <= the upper bound and `at_most_tokens`) whose backing
        (`backing_bytes`: what a resize to them would leave committed) fits the budget. When the most
        allowed fits, it is the answer without a search (memory pressure asks every 0.25 s, and a
        capped cache that fits is the usual answer)."""
        low, high = 0, self.reserved_tokens // self.page_size
        if at_most_tokens is not None:
            high = max(0, min(high, at_most_tokens // self.page_size))
        if self.backing_bytes(high * self.page_size) <= budget_bytes:
            return high * self.page_size
        if self.backing_bytes(0) > budget_bytes:
            return 0
        while low < high:
            mid = (low + high + 1) // 2
            if self.backing_bytes(mid * self.page_size) <= budget_bytes:
                low = mid
            else:
                high = mid - 1
        return low * self.page_size

    # -- backing ------------------------------------------------------------------------
    @property
    def arena(self) -> KvArena:
        if self._arena is None:
            raise RuntimeError(f"{type(self).__name__} has not placed its buffers yet")
        return self._arena

    @property
    def committed_bytes(self) -> int:
        return sum(buffer.committed_bytes for buffers in self._buffers.values() for buffer in buffers)

    @property
    def reserved_bytes(self) -> int:
        return sum(buffer.reserved_bytes for buffers in self._buffers.values() for buffer in buffers)

    def _back(self, num_tokens: int) -> None:
        self.arena.commit(self._targets(num_tokens))
        self.committed_tokens = num_tokens

    def ensure_prefix(self) -> None:
        """Back the dummy page of every buffer (what graph capture and padded rows touch)."""
        if self.committed_bytes < self.bytes_for_tokens(0):
            self.arena.commit(self._targets(0))

    def finalize_backing(self, num_tokens: int) -> int:
        """Back exactly what `num_tokens` usable tokens need; returns the page-aligned count.

        Raises `CommitError` (with nothing newly mapped) when the memory is not there.
        """
        if num_tokens < 0 or num_tokens > self.reserved_tokens:
            raise ValueError(
                f"cannot back {num_tokens} tokens: the pool's upper bound is {self.reserved_tokens} "
                f"(reserved {self.reserved_bytes / GIB:.2f} GiB of address space)"
            )
        num_tokens = num_tokens // self.page_size * self.page_size
        self._back(num_tokens)
        return num_tokens

    def release_backing(self) -> int:
        """Decommit every byte, the dummy page included (the engine sleeps: nothing runs until
        `ensure_prefix` and `finalize_backing` back it again); returns the bytes released."""
        released = self.committed_bytes
        self.arena.commit({name: 0 for name in self._targets(0)})
        self.committed_tokens = 0
        return released

    def close(self) -> None:
        """Drop this pool's views; release the arena too when the pool made it."""
        self._drop_views()
        if self.owns_arena and self._arena is not None:
            self._arena.close()

    def slot_map(self, layer_id: int) -> torch.Tensor | None:
        """Full-pool slot -> buffer row table of a layer, None where they are the same (every layer
        here; the sliding-window pool's window layers have one)."""
        return None

    def _drop_views(self) -> None:
        raise NotImplementedError

    # -- moving pages (a shrink under live requests, snugkv.memory.moves) --------------------
    def move_pages(self, moves: KvMoves) -> int:
        """Copy every moved page's KV, in every buffer, to its destination page, bit for bit;
        returns the bytes copied. The sources keep their contents (until they are decommitted)."""
        copied = 0
        for group, page_moves in self._moves_by_group(moves).items():
            if page_moves.num_pages:
                for buffer in self._kv_tensors(group):
                    copied += self._copy_pages(buffer, page_moves)
        return copied

    def page_views(self) -> list[torch.Tensor]:
        """Every KV buffer as `[pool pages, page bytes]` uint8 rows (row p: the bytes of page p's
        slots), for moving whole pages to and from another tier (snugkv.memory.host_tier). Views,
        never copies; a pool of one token group only (a sliding-window pool raises `ValueError`)."""
        if set(self._buffers) != {DEFAULT_GROUP}:
            raise ValueError(
                f"{type(self).__name__} keeps {len(self._buffers)} token groups; page views need one"
            )
        views = []
        for buffer in self._kv_tensors(DEFAULT_GROUP):
            raw = buffer.view(torch.uint8)
            pages = raw.shape[0] if self.layout is KVLayout.PAGE_MAJOR else raw.shape[0] // self.page_size
            views.append(raw.view(pages, -1))
        return views

    def _moves_by_group(self, moves: KvMoves) -> dict[str, PageMoves]:
        return {DEFAULT_GROUP: moves.full}

    def _kv_tensors(self, group: str) -> list[torch.Tensor]:
        """The KV buffers of a group (not per-slot tables such as a slot map)."""
        raise NotImplementedError

    def _copy_pages(self, buffer: torch.Tensor, moves: PageMoves) -> int:
        """Copy the moved rows of one buffer through a staging tensor of at most `MOVE_STAGING_BYTES`
        (a shrink runs when memory is short: it must not ask for the moved bytes at once)."""
        if self.layout is KVLayout.PAGE_MAJOR:
            sources, destinations = moves.src_pages, moves.dst_pages
        else:
            sources, destinations = moves.slots(self.page_size)
        raw = buffer.view(torch.uint8)  # the bytes themselves, whatever the dtype (fp8, NaN payloads)
        sources, destinations = sources.to(raw.device), destinations.to(raw.device)
        row_bytes = raw[0].numel()
        rows = widest_words(raw)
        rows_per_copy = max(1, MOVE_STAGING_BYTES // row_bytes)
        for start in range(0, sources.numel(), rows_per_copy):
            end = start + rows_per_copy
            rows.index_copy_(0, destinations[start:end], rows.index_select(0, sources[start:end]))
        return sources.numel() * row_bytes

    # -- what attention reads and writes (snugkv.core.forward.KVCache) -----------------------
    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        raise NotImplementedError

    # -- writes -------------------------------------------------------------------------
    def _store(self, buffer: torch.Tensor, loc: torch.Tensor, values: torch.Tensor) -> None:
        """Write `values [n, heads, dim]` into slots `loc` of a buffer in this pool's layout."""
        values = values.to(self.dtype)
        if self.dtype.itemsize == 1:  # index_put on fp8 is not implemented everywhere
            buffer, values = buffer.view(torch.uint8), values.view(torch.uint8)
        if self.layout is KVLayout.PAGE_MAJOR:
            buffer[loc // self.page_size, :, loc % self.page_size] = values
        else:
            buffer[loc] = values


@dataclass(frozen=True, slots=True)
class DraftKvShape:
    """A separate draft model's KV per token: `num_layers` layers of `num_kv_heads` heads of
    `head_dim` (K and V alike), kept beside the model's in the same pool (`MHAKVPool`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


class DraftKv:
    """The draft model's layers of an `MHAKVPool`, as attention reads and writes them
    (snugkv.core.forward.KVCache): the draft's layer `l` is the pool's layer `first_layer + l`,
    at the same token slots as the model's own layers."""

    def __init__(self, pool: MHAKVPool, first_layer: int) -> None:
        self.pool = pool
        self.first_layer = first_layer

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def layout(self) -> KVLayout:
        return self.pool.layout

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.get_kv_buffer(self.first_layer + layer_id)

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        self.pool.set_kv(self.first_layer + layer_id, loc, k, v)

    def slot_map(self, layer_id: int) -> torch.Tensor | None:
        return None


class MHAKVPool(KVPool):
    """K and V of a layer in one buffer (multi-head and grouped-query attention).

    A slot of layer `l`'s buffer holds its K heads then its V heads (`[2 * Hkv, D]`; page-major
    `[pages, 2 * Hkv, P, D]`); `get_kv_buffer` hands out the two halves as strided views, which the
    kernels address by their strides. One buffer per layer instead of two halves the extensions a
    resize maps or unmaps (a driver mapping costs ~35 us to unmap whatever its size:
    docs/bench/elastic.md), so a shrink of 10 GiB takes half the driver calls, and a move copies a
    slot's K and V in one row. Where V's head dim differs from K's, the layer keeps two buffers.

    `draft`: a separate draft model's layers (`--draft-model PATH`) get buffers of their own shape
    after the model's, as the pool's layers `num_layers ...` (`draft_kv()` addresses them from 0):
    the same slots, so one allocator hands out both and one arena backs both, and every resize,
    move, host-tier copy and sleep of the pool moves the draft's KV with the model's.
    """

    def __init__(
        self,
        spec: KVPoolSpec,
        *,
        reserved_tokens: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int | None = None,
        arena: KvArena | None = None,
        draft: DraftKvShape | None = None,
    ) -> None:
        super().__init__(spec, reserved_tokens=reserved_tokens, arena=arena)
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.layer_ids = list(range(num_layers))
        self.draft = draft
        self.fused = self.v_head_dim == head_dim
        heads = num_kv_heads
        if self.fused:
            # (kv heads, head dim) of every layer's buffer: the model's, then the draft's
            shapes = {layer: (heads, head_dim) for layer in self.layer_ids}
            if draft is not None:
                draft_shape = (draft.num_kv_heads, draft.head_dim)
                shapes |= {num_layers + index: draft_shape for index in range(draft.num_layers)}
            layouts = [
                BufferLayout(
                    f"{_buffer_name(layer, num_layers)}.kv",
                    self.dtype,
                    (2 * h, d),
                    self.page_size,
                    self.layout,
                )
                for layer, (h, d) in shapes.items()
            ]
            views = self._place({DEFAULT_GROUP: layouts})
            self.kv_buffers = [views[f"{_buffer_name(layer, num_layers)}.kv"] for layer in shapes]
            self.k_buffers = {layer: self.kv_buffers[layer][:, : shapes[layer][0]] for layer in shapes}
            self.v_buffers = {layer: self.kv_buffers[layer][:, shapes[layer][0] :] for layer in shapes}
            return
        if draft is not None:
            raise ValueError("a draft model's KV needs a pool whose K and V share a head dim")
        layouts = []
        for layer in self.layer_ids:
            layouts.append(
                BufferLayout(f"layer{layer}.k", self.dtype, (heads, head_dim), self.page_size, self.layout)
            )
            layouts.append(
                BufferLayout(
                    f"layer{layer}.v", self.dtype, (heads, self.v_head_dim), self.page_size, self.layout
                )
            )
        views = self._place({DEFAULT_GROUP: layouts})
        self.k_buffers = {layer: views[f"layer{layer}.k"] for layer in self.layer_ids}
        self.v_buffers = {layer: views[f"layer{layer}.v"] for layer in self.layer_ids}
        self.kv_buffers = [*self.k_buffers.values(), *self.v_buffers.values()]

    def draft_kv(self) -> DraftKv | None:
        """The draft model's layers, addressed from 0 (None: the pool holds no draft)."""
        return None if self.draft is None else DraftKv(self, self.num_layers)

    @property
    def draft_bytes_per_token(self) -> int:
        """Bytes one token's KV takes in the draft's layers (0 without a draft)."""
        return sum(
            buffer.layout.slot_bytes
            for buffer in self._buffers.get(DEFAULT_GROUP, [])
            if buffer.name.startswith(DRAFT_BUFFER_PREFIX)
        )

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        if v is None:
            raise ValueError("an MHA pool stores K and V: pass both")
        self._store(self.k_buffers[layer_id], loc, k)
        self._store(self.v_buffers[layer_id], loc, v)

    def _kv_tensors(self, group: str) -> list[torch.Tensor]:
        return list(self.kv_buffers)  # whole rows: a move copies a slot's K and V at once

    def _drop_views(self) -> None:
        self.k_buffers.clear()
        self.v_buffers.clear()
        self.kv_buffers.clear()


def _buffer_name(layer: int, num_layers: int) -> str:
    """`layer{l}` for the model's layers, `draft{l}` for a draft model's (numbered from 0)."""
    return f"layer{layer}" if layer < num_layers else f"{DRAFT_BUFFER_PREFIX}{layer - num_layers}"
