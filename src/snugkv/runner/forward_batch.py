"""ForwardBatch: everything one model forward needs to know about the batch it runs.

A batch's rows are requests. Row i adds `extend_lens[i] >= 1` new tokens on top of
`prefix_lens[i]` tokens already in the KV cache; the new tokens of all rows are concatenated
row-major along the T axis. The slots for the new tokens (`out_cache_loc`) were allocated and
written into `req_to_token` before the batch is built; this module never allocates.

Two modes:
- DECODE: every row adds exactly one token. Only device tensors are read during the forward
  (the CPU mirrors may be None), so the forward can be captured in a CUDA graph.
- EXTEND: anything else (prefill, prefix-cached extend, chunked prefill, rows mixed with decode
  rows). Backends may read the CPU mirrors of the lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from snugkv.attention.base import AttentionBackend


class ForwardMode(StrEnum):
    EXTEND = "extend"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class BatchRow:
    """One request's share of a forward: `token_ids` go at positions `prefix_len ...`.

    `need_logits` is False for a non-final prefill chunk, whose next token nobody samples.
    """

    req_pool_idx: int
    prefix_len: int
    token_ids: Sequence[int]
    need_logits: bool = True

    @property
    def seq_len(self) -> int:
        return self.prefix_len + len(self.token_ids)


@dataclass(slots=True)
class ForwardBatch:
    """Device tensors (and CPU mirrors of the lengths) for one forward; see the module docstring.

    `logits_indices` holds T-axis indices of the tokens whose logits the runner returns (the last
    new token of each row that needs them). `kv_width` bounds how many key columns a gathering
    decode path reads per row; graphs set it to the table width so the shape is static, eager
    batches leave it None (meaning `max(seq_lens)`). `attn_metadata` is the attention backend's
    own per-batch state, set by `AttentionBackend.init_forward_metadata`.
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    out_cache_loc: torch.Tensor
    logits_indices: torch.Tensor
    req_to_token: torch.Tensor
    kv_pool: Any
    attn_backend: AttentionBackend
    seq_lens_cpu: tuple[int, ...] | None = None
    prefix_lens_cpu: tuple[int, ...] | None = None
    extend_lens_cpu: tuple[int, ...] | None = None
    kv_width: int | None = None
    attn_metadata: Any = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    @classmethod
    def build(
        cls,
        rows: Sequence[BatchRow],
        out_cache_loc: torch.Tensor,
        *,
        req_to_token: torch.Tensor,
        kv_pool: Any,
        attn_backend: AttentionBackend,
    ) -> ForwardBatch:
        """A batch for `rows` whose new tokens' slots are `out_cache_loc` (already in the table)."""
        if not rows:
            raise ValueError("a forward batch needs at least one row")
        for row in rows:
            if len(row.token_ids) == 0:
                raise ValueError(f"request row {row.req_pool_idx} adds no tokens; every row needs >= 1")
            if row.prefix_len < 0:
                raise ValueError(f"request row {row.req_pool_idx} has prefix_len {row.prefix_len} < 0")
        device = req_to_token.device
        prefix_lens = [row.prefix_len for row in rows]
        extend_lens = [len(row.token_ids) for row in rows]
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        decode = all(e == 1 for e in extend_lens) and all(r.need_logits for r in rows)
        if decode:  # the hot path: one token per row, no per-row ranges
            total = len(rows)
            starts = list(range(total))
            positions = prefix_lens
            input_ids = [row.token_ids[0] for row in rows]
            logits_rows = starts
        else:
            starts, total = [], 0
            for length in extend_lens:
                starts.append(total)
                total += length
            positions = [position for p, s in zip(prefix_lens, seq_lens) for position in range(p, s)]
            input_ids = [t for row in rows for t in row.token_ids]
            logits_rows = [
                start + length - 1 for row, start, length in zip(rows, starts, extend_lens) if row.need_logits
            ]
        if out_cache_loc.numel() != total:
            raise ValueError(f"out_cache_loc holds {out_cache_loc.numel()} slots for {total} new tokens")
        # Every index tensor goes to the device in one copy, then is split into views.
        parts = (
            input_ids,
            positions,
            [row.req_pool_idx for row in rows],
            seq_lens,
            prefix_lens,
            extend_lens,
            starts,
            logits_rows,
        )
        packed = torch.tensor([value for part in parts for value in part], dtype=torch.int64)
        if device.type == "cuda":
            packed = packed.pin_memory().to(device, non_blocking=True)
        views = torch.split(packed, [len(part) for part in parts])
        mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
        return cls(
            mode=mode,
            input_ids=views[0],
            positions=views[1],
            req_pool_indices=views[2],
            seq_lens=views[3],
            prefix_lens=views[4],
            extend_lens=views[5],
            extend_start_loc=views[6],
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
            logits_indices=views[7],
            req_to_token=req_to_token,
            kv_pool=kv_pool,
            attn_backend=attn_backend,
            seq_lens_cpu=tuple(seq_lens),
            prefix_lens_cpu=tuple(prefix_lens),
            extend_lens_cpu=tuple(extend_lens),
        )
