"""Plain-torch paged attention: gather each request's K/V slots, then scaled dot product.

This is the oracle every other backend is tested against, so it favours the obvious over the
fast: K/V are gathered slot by slot from the pool in either layout, upcast to float32 (fp8 pools
included), masked with the causal and sliding-window rule of docs/ARCHITECTURE.md and reduced in
float32. It runs on CPU and GPU, and is what CPU runs.

Two paths:
- EXTEND batches loop over rows in Python using the CPU length mirrors.
- DECODE batches gather `kv_width` columns of every row at once and mask the tail, reading only
  device tensors, so a decode forward through this backend can be captured in a CUDA graph
  (kv_width must then be static: the graph runner sets it to the table width).

What is the same in every layer of a forward (each row's slots, the masks per sliding window) is
worked out once per forward (`init_forward_metadata`, or at the first layer), not once per layer:
on a CPU those small ops cost as much as the attention itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from snugkv.core.forward import AttentionBackend, AttentionLayer, ForwardBatch


def gather_kv(buffer: torch.Tensor, slots: torch.Tensor, layout: str, page_size: int) -> torch.Tensor:
    """Rows of `buffer` for `slots` (any shape `S`) as `[*S, heads, dim]` in float32.

    Token-major buffers are `[slots, heads, dim]`; page-major ones `[pages, heads, page_size, dim]`.
    """
    flat = slots.reshape(-1).long()
    source = buffer
    if buffer.element_size() == 1:  # indexing is not implemented for fp8 everywhere: move bytes
        source = buffer.view(torch.uint8)
    rows = source[flat // page_size, :, flat % page_size] if layout == "hnd" else source.index_select(0, flat)
    if buffer.element_size() == 1:
        rows = rows.view(buffer.dtype)
    return rows.to(torch.float32).reshape(*slots.shape, *rows.shape[1:])


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Masked GQA attention in float32.

    q `[B, Lq, Hq, D]`, k `[B, Lk, Hkv, D]`, v `[B, Lk, Hkv, Dv]`, hidden `[B, Lq, Lk]` (bool, True
    where a query must not see a key) -> `[B, Lq, Hq, Dv]` float32. Every query must see at least
    one key. Two batched matmuls over (row, KV head), each KV head's query heads stacked: the
    contraction einsum "bqhgd,bkhd->bhgqk" runs, without its per-call planning.
    """
    batch, len_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    grouped = q.to(torch.float32).reshape(batch, len_q, num_kv_heads, group, head_dim)
    grouped = grouped.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group * len_q, head_dim)
    scores = torch.matmul(grouped, k.permute(0, 2, 3, 1)).unflatten(2, (group, len_q)) * scaling
    scores = scores.masked_fill(hidden[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).flatten(2, 3)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3)).unflatten(2, (group, len_q))
    return out.permute(0, 3, 1, 2, 4).reshape(batch, len_q, num_heads, v.shape[-1])


def attend_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """`attend` for one query per row, bit for bit, in fewer ops: q `[B, Hq, D]`, k `[B, Lk, Hkv, D]`,
    v `[B, Lk, Hkv, Dv]`, hidden `[B, Lk]` or None (every key visible) -> `[B, Hq, Dv]` float32."""
    batch, num_heads, head_dim = q.shape
    _, width, num_kv_heads, _ = k.shape
    group, v_dim = num_heads // num_kv_heads, v.shape[-1]
    grouped = q.to(torch.float32).reshape(batch * num_kv_heads, group, head_dim)
    keys = k.permute(0, 2, 3, 1).reshape(batch * num_kv_heads, head_dim, width)
    scores = torch.bmm(grouped, keys).mul_(scaling)
    if hidden is not None:
        scores.view(batch, num_kv_heads, group, width).masked_fill_(hidden[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    values = v.permute(0, 2, 1, 3).reshape(batch * num_kv_heads, width, v_dim)
    return torch.bmm(probs, values).view(batch, num_heads, v_dim)


def allowed_keys(query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """`[..., Lq, Lk]` mask: key kp is visible from query qp iff kp <= qp (and qp - kp < window)."""
    distance = query_pos[..., :, None] - key_pos[..., None, :]
    allowed = distance >= 0
    if sliding_window is not None:
        allowed &= distance < sliding_window
    return allowed


@dataclass(slots=True)
class _Keys:
    """The keys one group of queries reads, the same in every layer of a forward: full-cache
    `slots` (any shape; a layer with a slot map translates them), and the masks of keys hidden
    from each query, made once per sliding window.

    `sees_all` (decode): every row's query sees every one of the `slots` columns unless a sliding
    window narrower than them hides some (an eager decode batch whose rows are all as long as the
    widest): the mask is then left out.
    """

    slots: torch.Tensor
    query_pos: torch.Tensor
    key_pos: torch.Tensor
    valid: torch.Tensor | None = None  # decode: the columns inside each row's sequence
    sees_all: bool = False
    hidden: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def hidden_for(self, sliding_window: int | None) -> torch.Tensor | None:
        """Decode: `[B, Lk]`; extend: `[Lq, Lk]` (True: hidden from the query); None: nothing hidden."""
        if sliding_window in self.hidden:
            return self.hidden[sliding_window]
        mask: torch.Tensor | None = None
        width = int(self.slots.shape[-1])
        if not (self.sees_all and (sliding_window is None or sliding_window >= width)):
            allowed = allowed_keys(self.query_pos, self.key_pos, sliding_window)
            if self.valid is not None:  # decode: [B, 1, Lk] -> [B, Lk]
                allowed = self.valid & allowed[:, 0]
            mask = ~allowed
        self.hidden[sliding_window] = mask
        return mask


@dataclass(slots=True)
class TorchAttentionMetadata:
    """Per forward: the decode batch's keys, or an extend batch's keys row by row."""

    decode: _Keys | None = None
    rows: list[_Keys] = field(default_factory=list)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        metadata = TorchAttentionMetadata()
        if forward_batch.is_decode:
            metadata.decode = self._decode_keys(forward_batch)
        else:
            metadata.rows = self._extend_keys(forward_batch)
        forward_batch.attn_metadata = metadata

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
        pool = forward_batch.kv_pool
        if save_kv and k is not None:
            pool.set_kv(layer.layer_id, forward_batch.out_cache_loc, k, v)
        if not isinstance(forward_batch.attn_metadata, TorchAttentionMetadata):
            self.init_forward_metadata(forward_batch)
        metadata = forward_batch.attn_metadata
        if metadata.decode is not None:
            result = self._decode(q, layer, forward_batch, metadata.decode)
        else:
            result = self._extend(q, layer, forward_batch, metadata.rows)
        if out is None:
            return result.to(q.dtype)
        return out.copy_(result)

    def _read(
        self, slots: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pool = forward_batch.kv_pool
        slot_map = pool.slot_map(layer.layer_id)
        if slot_map is not None:
            slots = slot_map[slots.long()]
        k_buffer, v_buffer = pool.get_kv_buffer(layer.layer_id)
        layout, page_size = str(pool.layout), pool.page_size
        return gather_kv(k_buffer, slots, layout, page_size), gather_kv(v_buffer, slots, layout, page_size)

    @staticmethod
    def _decode_keys(forward_batch: ForwardBatch) -> _Keys:
        table = forward_batch.req_to_token
        width = forward_batch.kv_width
        if width is None:
            if forward_batch.seq_lens_cpu is None:
                raise ValueError("a decode batch without CPU seq_lens needs a static kv_width")
            width = max(forward_batch.seq_lens_cpu)
        width = min(width, table.shape[1])
        seq_lens = forward_batch.seq_lens
        key_pos = torch.arange(width, device=seq_lens.device)
        valid = key_pos[None, :] < seq_lens[:, None]
        # Columns past a row's end may hold stale slots of another request: read slot 0 instead.
        slots = torch.where(valid, table[forward_batch.req_pool_indices, :width], 0).long()
        # Host lengths only (an eager batch): a captured graph keeps its mask, whatever the lengths.
        sees_all = (
            forward_batch.kv_width is None
            and forward_batch.seq_lens_cpu is not None
            and min(forward_batch.seq_lens_cpu) >= width
        )
        return _Keys(slots, (seq_lens - 1)[:, None], key_pos[None, :], valid, sees_all)

    @staticmethod
    def _extend_keys(forward_batch: ForwardBatch) -> list[_Keys]:
        if forward_batch.seq_lens_cpu is None or forward_batch.prefix_lens_cpu is None:
            raise ValueError("an extend batch needs the CPU mirrors of seq_lens and prefix_lens")
        seq_lens, prefix_lens = forward_batch.seq_lens_cpu, forward_batch.prefix_lens_cpu
        table = forward_batch.req_to_token[forward_batch.req_pool_indices, : max(seq_lens)]
        device = table.device
        return [
            _Keys(
                table[row, :seq_len].long(),
                torch.arange(prefix_len, seq_len, device=device),
                torch.arange(seq_len, device=device),
            )
            for row, (prefix_len, seq_len) in enumerate(zip(prefix_lens, seq_lens))
        ]

    def _decode(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch, keys: _Keys
    ) -> torch.Tensor:
        key_rows, value_rows = self._read(keys.slots, layer, forward_batch)
        return attend_decode(q, key_rows, value_rows, keys.hidden_for(layer.sliding_window), layer.scaling)

    def _extend(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch, rows: list[_Keys]
    ) -> torch.Tensor:
        outputs, start = [], 0
        for keys in rows:
            extend_len = int(keys.query_pos.shape[0])
            key_rows, value_rows = self._read(keys.slots, layer, forward_batch)
            hidden = keys.hidden_for(layer.sliding_window)
            assert hidden is not None  # only decode rows may see every key
            row_q = q[start : start + extend_len]
            outputs.append(
                attend(row_q[None], key_rows[None], value_rows[None], hidden[None], layer.scaling)[0]
            )
            start += extend_len
        return torch.cat(outputs, dim=0)
