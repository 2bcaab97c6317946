"""One model forward: the batch it runs, and the contracts between the model's attention layers,
the KV cache and the attention backend (they meet in one forward, so they live in one module).

A batch's rows are requests. Row i adds `extend_lens[i] >= 1` new tokens on top of
`prefix_lens[i]` tokens already in the KV cache; the new tokens of all rows are concatenated
row-major along the T axis. The slots for the new tokens (`out_cache_loc`) were allocated and
written into `req_to_token` before the batch is built; this module never allocates.

Two modes:
- DECODE: every row adds exactly one token. Only device tensors are read during the forward
  (the CPU mirrors may be None), so the forward can be captured in a CUDA graph. A decode row's
  token may be `FUTURE_TOKEN`: the token the previous step sampled for that request, not yet on
  the host; the runner fills it in on the device before the forward (runner.future_tokens).
  A speculative verify step (every row its last token and its draft, logits at every position)
  is a DECODE batch too, of one row per position: position j of a request is a row of its own with
  `seq_len = prefix_len + j + 1`, which is exactly what it attends to, so verification replays
  the decode graphs (`ForwardBatch.build` unrolls the rows; the logits keep the rows' order).
- EXTEND: anything else (prefill, prefix-cached extend, chunked prefill, rows mixed with decode
  rows). Backends may read the CPU mirrors of the lengths. A mixed step puts the running
  requests' decode rows first: the leading `num_decode_rows` rows each add one sampled token on
  top of a prefix, may take `FUTURE_TOKEN` as a decode row does, and a backend may run them
  through its decode kernel and only the rows after them through its extend kernel.

`AttentionBackend.forward(q, k, v, layer, forward_batch)`:
- Inputs are the new tokens of the batch, concatenated row-major (docs/ARCHITECTURE.md):
  q `[T, layer.num_heads, layer.head_dim]`, k `[T, layer.num_kv_heads, layer.head_dim]`,
  v `[T, layer.num_kv_heads, layer.v_head_dim]`, all in the compute dtype.
- The backend first writes k/v into the cache: `kv_cache.set_kv(layer.layer_id, out_cache_loc, k, v)`
  (the cache casts to its storage dtype), unless `save_kv=False`: the caller wrote them already
  (the fused RoPE + KV-store kernel does); k and v are still passed, extend kernels read them.
- Then the new token j of row i, at position `qp = prefix_lens[i] + j`, attends to every key
  position `kp` of `req_to_token[req_pool_indices[i], :seq_lens[i]]` with `kp <= qp` and, for a
  sliding-window layer, `qp - kp < layer.sliding_window`; scores are scaled by `layer.scaling`;
  query head h uses KV head `h // (num_heads // num_kv_heads)` (GQA).
- It returns `[T, layer.num_heads, layer.v_head_dim]` in q's dtype. KV read from an fp8 cache is
  upcast; accumulation is at least fp32.
- Slots from the table are full-cache slots; a layer whose buffers are indexed differently (a
  sliding-window sub-pool) has a `kv_cache.slot_map(layer_id)` to translate them through.

`init_forward_metadata(forward_batch)` runs once per forward, before the first layer; a backend
may put shared per-batch state into `forward_batch.attn_metadata`. For a DECODE batch captured in
a CUDA graph it runs inside the capture: device ops only, no host sync, shapes that depend only
on the batch size and `forward_batch.kv_width` (CPU length mirrors are None there).

A backend never allocates slots, never writes the request-to-token table and never frees.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import torch


class KVCache(Protocol):
    """What attention reads and writes of a KV pool (snugkv.memory's pools implement it)."""

    @property
    def page_size(self) -> int: ...

    @property
    def layout(self) -> str:
        """ "nhd" (token-major) or "hnd" (page-major); see docs/ARCHITECTURE.md."""
        ...

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None: ...

    def slot_map(self, layer_id: int) -> torch.Tensor | None:
        """The table mapping full-cache slots to this layer's buffer rows, or None (identity)."""
        ...


class AttentionLayer(Protocol):
    """What a backend needs to know about one layer's attention (snugkv.layers.PagedAttention)."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scaling: float
    sliding_window: int | None


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
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        *,
        save_kv: bool = True,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write the new K/V, attend, return `[T, num_heads, v_head_dim]` (see the module docstring);
        into `out` when given (the piecewise graphs' static output)."""


FUTURE_TOKEN = -1  # a decode row's input that the previous step sampled and the host has not read


class ForwardMode(StrEnum):
    EXTEND = "extend"
    DECODE = "decode"


@dataclass(slots=True)
class BatchRow:
    """One request's share of a forward: `token_ids` go at positions `prefix_len ...`.

    `need_logits` is False for a non-final prefill chunk, whose next token nobody samples.
    `prompt_logits`: the runner returns the logits of every new token of the row (in position
    order; the last is the one sampled when `need_logits`), for the prompt's log-probabilities.
    `draft_len`: the last `draft_len` tokens are a speculative draft after the row's last token;
    the runner returns the logits of every new token of the row too (`draft_len + 1` of them, the
    layout snugkv.speculative.verify reads).
    Not frozen: one is built per request per step, and a frozen `__init__` costs three times more.
    """

    req_pool_idx: int
    prefix_len: int
    token_ids: Sequence[int]
    need_logits: bool = True
    prompt_logits: bool = False
    draft_len: int = 0

    @property
    def seq_len(self) -> int:
        return self.prefix_len + len(self.token_ids)


@dataclass(slots=True)
class ForwardBatch:
    """Device tensors (and CPU mirrors of the lengths) for one forward; see the module docstring.

    `logits_indices` holds T-axis indices of the tokens whose logits the runner returns (the last
    new token of each row that needs them; every new token of a `prompt_logits` row or of a row with
    a draft). `kv_width` bounds how many key columns a gathering
    decode path reads per row; graphs set it to the table width so the shape is static, eager
    batches leave it None (meaning `max(seq_lens)`). `attn_metadata` is the attention backend's
    own per-batch state, set by `AttentionBackend.init_forward_metadata`. `reads_future_tokens`:
    some decode row's input id is `FUTURE_TOKEN`, filled in on the device before the forward.
    `num_decode_rows`: of an EXTEND batch, how many leading rows are decode rows (one sampled
    token on a prefix: a mixed step's running requests); 0 for a DECODE batch (all of it decodes).
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
    kv_pool: KVCache
    attn_backend: AttentionBackend
    seq_lens_cpu: tuple[int, ...] | None = None
    prefix_lens_cpu: tuple[int, ...] | None = None
    extend_lens_cpu: tuple[int, ...] | None = None
    kv_width: int | None = None
    attn_metadata: Any = None
    reads_future_tokens: bool = False
    num_decode_rows: int = 0

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
        kv_pool: KVCache,
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
        decode_rows = _leading_decode_rows(rows)
        decode = decode_rows == len(rows)
        if not decode and all(_verifies(row) for row in rows):  # a row per position (module docstring)
            rows = [
                BatchRow(row.req_pool_idx, row.prefix_len + j, [token])
                for row in rows
                for j, token in enumerate(row.token_ids)
            ]
            prefix_lens = [row.prefix_len for row in rows]
            extend_lens = [1] * len(rows)
            seq_lens = [p + 1 for p in prefix_lens]
            decode, decode_rows = True, len(rows)
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
            if min(input_ids[decode_rows:], default=0) < 0:
                raise ValueError(
                    "only a decode row (one sampled token on a prefix, ahead of every other row) may "
                    "take the previous step's token (FUTURE_TOKEN)"
                )
            logits_rows = []
            for row, start, length in zip(rows, starts, extend_lens):
                if row.prompt_logits or row.draft_len:
                    logits_rows.extend(range(start, start + length))
                elif row.need_logits:
                    logits_rows.append(start + length - 1)
        if out_cache_loc.numel() != total:
            raise ValueError(f"out_cache_loc holds {out_cache_loc.numel()} slots for {total} new tokens")
        # Every index tensor goes to the device in one copy, then is split into views. Each view
        # starts 16 bytes in (an odd part is padded): Triton compiles a kernel again for a pointer
        # that is not 16-byte aligned, which a batch of an odd row count would otherwise hand it.
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
        sizes = [len(part) for part in parts]
        values: list[int] = []
        for part, size in zip(parts, sizes):
            values.extend(part)
            if size % 2:
                values.append(0)
        packed = torch.tensor(values, dtype=torch.int64)
        if device.type == "cuda":
            packed = packed.pin_memory().to(device, non_blocking=True)
        views = [
            view[:size] for view, size in zip(torch.split(packed, [size + size % 2 for size in sizes]), sizes)
        ]
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
            reads_future_tokens=decode_rows > 0 and min(input_ids[:decode_rows]) < 0,
            num_decode_rows=0 if decode else decode_rows,
        )


def _verifies(row: BatchRow) -> bool:
    """A verify step's row: its last token (maybe `FUTURE_TOKEN`, still on the device) and its draft
    (maybe empty), every position sampled."""
    tokens = row.token_ids
    return row.need_logits and row.draft_len == len(tokens) - 1 and min(tokens[1:], default=0) >= 0


def _leading_decode_rows(rows: Sequence[BatchRow]) -> int:
    """How many rows, from the first, add one token whose logits are sampled (a row that only
    scores a one-token prompt counts too: its one logits row is the same)."""
    count = 0
    for row in rows:
        if len(row.token_ids) != 1 or not row.need_logits:
            break
        count += 1
    return count
