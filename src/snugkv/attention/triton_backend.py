"""Triton paged attention behind the `AttentionBackend` interface (the GPU path).

Decode rows go to the split-KV decode kernel, every other batch to the extend kernel, which
reads the cached prefix through the request-to-token table and the new tokens from q/k/v
directly. A mixed step (a prefill with the running requests' decode rows ahead of it) runs both:
its decode rows through the decode kernel, the rows after them through the extend kernel (one
query token per program over a long prefix would read each KV head once per query head, and
without splitting the keys one long row would hold up the step). SWA window layers pass the
pool's `full_to_swa` table as `kv_slot_map`, so the kernels translate slots on the device.
Nothing here syncs with the host on a decode batch: the decode workspace is allocated per batch
shape (inside the graph's pool when captured).
"""

from __future__ import annotations

import torch

from snugkv.attention.triton_decode import decode_attention, decode_splits, decode_workspace
from snugkv.attention.triton_extend import extend_attention
from snugkv.core.forward import AttentionBackend, AttentionLayer, ForwardBatch


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, num_kv_splits: int | None = None) -> None:
        """`num_kv_splits`: a fixed split count for decode; None picks it by batch size."""
        self.num_kv_splits = num_kv_splits

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        max_extend_len = max_prefix_len = None
        decode_rows = forward_batch.num_decode_rows
        if not forward_batch.is_decode and forward_batch.extend_lens_cpu is not None:
            max_extend_len = max(forward_batch.extend_lens_cpu[decode_rows:])
        if not forward_batch.is_decode and forward_batch.prefix_lens_cpu:
            max_prefix_len = max(forward_batch.prefix_lens_cpu[decode_rows:])
        forward_batch.attn_metadata = {
            "max_extend_len": max_extend_len,
            "max_prefix_len": max_prefix_len,
            "workspace": {},
            # a mixed step's extend rows, in tensors of their own: a slice at an odd int64 offset is
            # not 16-byte aligned, and Triton compiles another variant of a kernel for that, on the
            # serving thread (the likely cause of a fresh H100 server's slow first mixed steps, d8b0d66)
            "extend_rows": (
                forward_batch.req_pool_indices[decode_rows:].clone(),
                forward_batch.prefix_lens[decode_rows:].clone(),
                forward_batch.extend_lens[decode_rows:].clone(),
                forward_batch.extend_start_loc[decode_rows:] - decode_rows,  # after the decode rows' tokens
            )
            if decode_rows
            else (
                forward_batch.req_pool_indices,
                forward_batch.prefix_lens,
                forward_batch.extend_lens,
                forward_batch.extend_start_loc,
            ),
        }

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
        if forward_batch.attn_metadata is None:
            self.init_forward_metadata(forward_batch)
        if save_kv and k is not None:
            pool.set_kv(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buffer, v_buffer = pool.get_kv_buffer(layer.layer_id)
        slot_map = pool.slot_map(layer.layer_id)
        if out is None:
            out = torch.empty((q.shape[0], layer.num_heads, layer.v_head_dim), dtype=q.dtype, device=q.device)
        decode_rows = forward_batch.batch_size if forward_batch.is_decode else forward_batch.num_decode_rows
        if decode_rows:
            splits = self.num_kv_splits or decode_splits(decode_rows, layer.num_kv_heads)
            partial_out, partial_lse = self._workspace(forward_batch, decode_rows, layer, splits, q.device)
            decode_attention(
                q[:decode_rows],
                k_buffer,
                v_buffer,
                out[:decode_rows],
                forward_batch.req_to_token,
                forward_batch.req_pool_indices[:decode_rows],
                forward_batch.seq_lens[:decode_rows],
                num_kv_splits=splits,
                partial_out=partial_out,
                partial_lse=partial_lse,
                sm_scale=layer.scaling,
                page_size=pool.page_size,
                layout=str(pool.layout),
                sliding_window=layer.sliding_window,
                kv_slot_map=slot_map,
            )
            if decode_rows == forward_batch.batch_size:
                return out
        if k is None or v is None:
            raise ValueError("the Triton extend kernel reads new K/V from the call: pass k and v, not None")
        metadata = forward_batch.attn_metadata
        req_pool_indices, prefix_lens, extend_lens, extend_start_loc = metadata["extend_rows"]
        extend_attention(
            q[decode_rows:],
            k[decode_rows:],
            v[decode_rows:],
            out[decode_rows:],
            k_buffer,
            v_buffer,
            forward_batch.req_to_token,
            req_pool_indices,
            prefix_lens,
            extend_lens,
            extend_start_loc,
            max_extend_len=metadata["max_extend_len"],
            max_prefix_len=metadata["max_prefix_len"],
            sm_scale=layer.scaling,
            page_size=pool.page_size,
            layout=str(pool.layout),
            sliding_window=layer.sliding_window,
            kv_slot_map=slot_map,
        )
        return out

    def _workspace(
        self, forward_batch: ForwardBatch, rows: int, layer: AttentionLayer, splits: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (rows, layer.num_heads, layer.v_head_dim, splits)
        cache = forward_batch.attn_metadata["workspace"]
        if key not in cache:
            cache[key] = decode_workspace(*key, device)
        return cache[key]
