"""Buffer layouts: the one place that turns a token count into bytes.

A `BufferLayout` describes one KV buffer (a layer's K, V or MLA latent, or a per-slot
table such as the SWA slot mapping): the shape one slot occupies, its dtype and how slots are
grouped into rows. Token-major (NHD) buffers hold one slot per row, `[slots, heads, dim]`;
page-major (HND) buffers hold one page per row, `[pages, heads, page_size, dim]`. Page 0 is the
dummy page (docs/ARCHITECTURE.md), so N usable tokens need N + page_size slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import torch

KV_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
}


def parse_kv_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name in KV_DTYPES.values():
            return name
        raise ValueError(f"KV dtype {name} is not supported; use one of {', '.join(KV_DTYPES)}")
    aliases = {
        "fp16": "float16",
        "half": "float16",
        "bf16": "bfloat16",
        "fp32": "float32",
        "float": "float32",
        "fp8": "fp8_e4m3",
        "float8_e4m3fn": "fp8_e4m3",
    }
    key = aliases.get(name, name)
    if key not in KV_DTYPES:
        raise ValueError(f"KV dtype {name!r} is not supported; use one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[key]


class KVLayout(StrEnum):
    TOKEN_MAJOR = "nhd"
    PAGE_MAJOR = "hnd"


@dataclass(frozen=True, slots=True)
class BufferLayout:
    """Shape and byte math of one buffer.

    `slot_shape` is what one slot holds: `(heads, dim)` for K/V, `(1, latent_dim)` for MLA,
    `()` for a per-slot scalar table. Page-major needs a non-empty `slot_shape`.
    """

    name: str
    dtype: torch.dtype
    slot_shape: tuple[int, ...]
    page_size: int
    layout: KVLayout = KVLayout.TOKEN_MAJOR

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.layout is KVLayout.PAGE_MAJOR and not self.slot_shape:
            raise ValueError(f"{self.name}: a page-major buffer needs a (heads, ...) slot shape")

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def slot_bytes(self) -> int:
        return math.prod(self.slot_shape) * self.itemsize

    @property
    def tokens_per_row(self) -> int:
        return self.page_size if self.layout is KVLayout.PAGE_MAJOR else 1

    @property
    def row_shape(self) -> tuple[int, ...]:
        if self.layout is KVLayout.PAGE_MAJOR:
            return (self.slot_shape[0], self.page_size, *self.slot_shape[1:])
        return self.slot_shape

    @property
    def row_bytes(self) -> int:
        return self.slot_bytes * self.tokens_per_row

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages that N usable tokens occupy, the dummy page included."""
        if num_tokens < 0:
            raise ValueError(f"token count must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.page_size) + 1

    def rows_for_tokens(self, num_tokens: int) -> int:
        return self.pages_for_tokens(num_tokens) * self.page_size // self.tokens_per_row

    def shape_for_tokens(self, num_tokens: int) -> tuple[int, ...]:
        return (self.rows_for_tokens(num_tokens), *self.row_shape)

    def bytes_for_tokens(self, num_tokens: int) -> int:
        """Exact bytes that must be backed so every slot of N usable tokens (and the dummy page) is."""
        return self.rows_for_tokens(num_tokens) * self.row_bytes

    def slot_byte_range(self, slot: int) -> tuple[int, int]:
        """First byte and one past the last byte that `slot` touches in this buffer."""
        if self.layout is KVLayout.TOKEN_MAJOR:
            return slot * self.row_bytes, (slot + 1) * self.row_bytes
        page, offset = divmod(slot, self.page_size)
        heads = self.slot_shape[0]
        per_head_slot = self.slot_bytes // heads
        start = page * self.row_bytes + offset * per_head_slot
        last_head = page * self.row_bytes + ((heads - 1) * self.page_size + offset) * per_head_slot
        return start, last_head + per_head_slot
