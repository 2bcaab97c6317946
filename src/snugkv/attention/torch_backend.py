"""Plain-torch paged attention: gather each request's K/V slots, then scaled dot product.

This is the oracle every other backend is tested against, so it favours the obvious over the
fast: K/V are gathered slot by slot from the pool in either layout, upcast to float32 (fp8 pools
included), masked with the causal and sliding-window rule of docs/ARCHITECTURE.md and reduced in
float32. It runs on CPU and GPU.

Two paths:
- EXTEND batches loop over rows in Python using the CPU length mirrors.
- DECODE batches gather `kv_width` columns of every row at once and mask the tail, reading only
  device tensors, so a decode forward through this backend can be captured in a CUDA graph
  (kv_width must then be static: the graph runner sets it to the table width).
"""

from __future__ import annotations

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
    rows = source[flat // page_size, :, flat % page_size] if layout == "hnd" else source[flat]
    if buffer.element_size() == 1:
        rows = rows.view(buffer.dtype)
    return rows.to(torch.float32).reshape(*slots.shape, *rows.shape[1:])


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Masked GQA attention in float32.

    q `[B, Lq, Hq, D]`, k `[B, Lk, Hkv, D]`, v `[B, Lk, Hkv, Dv]`, allowed `[B, Lq, Lk]` (bool)
    -> `[B, Lq, Hq, Dv]` float32. Every query must be allowed at least one key.
    """
    batch, len_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    grouped = q.to(torch.float32).reshape(batch, len_q, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", grouped, k) * scaling
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v)
    return out.reshape(batch, len_q, num_heads, v.shape[-1])


def allowed_keys(query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """`[..., Lq, Lk]` mask: key kp is visible from query qp iff kp <= qp (and qp - kp < window)."""
    distance = query_pos[..., :, None] - key_pos[..., None, :]
    allowed = distance >= 0
    if sliding_window is not None:
        allowed &= distance < sliding_window
    return allowed


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

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
        if forward_batch.is_decode:
            result = self._decode(q, layer, forward_batch)
        else:
            result = self._extend(q, layer, forward_batch)
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

    def _decode(self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch) -> torch.Tensor:
        table = forward_batch.req_to_token
        width = forward_batch.kv_width
        if width is None:
            if forward_batch.seq_lens_cpu is None:
                raise ValueError("a decode batch without CPU seq_lens needs a static kv_width")
            width = max(forward_batch.seq_lens_cpu)
        width = min(width, table.shape[1])
        seq_lens = forward_batch.seq_lens
        key_pos = torch.arange(width, device=q.device)
        valid = key_pos[None, :] < seq_lens[:, None]
        query_pos = (seq_lens - 1)[:, None]
        allowed = valid[:, None, :] & allowed_keys(query_pos, key_pos[None, :], layer.sliding_window)
        # Columns past a row's end may hold stale slots of another request: read slot 0 instead.
        slots = torch.where(valid, table[forward_batch.req_pool_indices, :width], 0)
        keys, values = self._read(slots, layer, forward_batch)
        out = attend(q[:, None], keys, values, allowed, layer.scaling)
        return out[:, 0]

    def _extend(self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch) -> torch.Tensor:
        if forward_batch.seq_lens_cpu is None or forward_batch.prefix_lens_cpu is None:
            raise ValueError("an extend batch needs the CPU mirrors of seq_lens and prefix_lens")
        seq_lens, prefix_lens = forward_batch.seq_lens_cpu, forward_batch.prefix_lens_cpu
        table = forward_batch.req_to_token[forward_batch.req_pool_indices, : max(seq_lens)]
        outputs, start = [], 0
        for row, (prefix_len, seq_len) in enumerate(zip(prefix_lens, seq_lens)):
            extend_len = seq_len - prefix_len
            keys, values = self._read(table[row, :seq_len], layer, forward_batch)
            query_pos = torch.arange(prefix_len, seq_len, device=q.device)
            key_pos = torch.arange(seq_len, device=q.device)
            allowed = allowed_keys(query_pos, key_pos, layer.sliding_window)
            row_q = q[start : start + extend_len]
            outputs.append(attend(row_q[None], keys[None], values[None], allowed[None], layer.scaling)[0])
            start += extend_len
        return torch.cat(outputs, dim=0)
