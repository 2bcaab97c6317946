"""Writing K/V rows into a KV pool buffer from Triton: slot addressing, the storage cast, `store_kv`.

Slot addressing follows docs/ARCHITECTURE.md. Slot `s` of a buffer lives at
`(s // PAGE) * stride_page + head * stride_head + (s % PAGE) * stride_offset + d * stride_dim`:
token-major "nhd" `[slots, Hkv, D]` with PAGE = 1 and stride_offset = 0, page-major "hnd"
`[pages, Hkv, P, D]` with PAGE = P. Every stride is honoured, because pool buffers are views over a
virtual-memory arena and an MLA value buffer is a column slice of the latent buffer. With a
`kv_slot_map` (a sliding-window sub-pool's `full_to_swa`) the slot is translated first.

The storage cast matches attention/triton_store.py: fp16/bf16/fp32 take a plain cast; float8_e4m3fn
(scale 1) saturates to +-448 first instead of turning large values into NaN.

`store_kv` writes k (and v) of `n` tokens in one launch, grid `(n, Hkv)`, reading slots on the device:
no host sync and shapes fixed by `loc`, so it can be captured in a CUDA graph. Must never import
from snugkv (kernels sit at the bottom of the import graph) nor loop over slots in Python.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from snugkv.kernels.device import runs_triton, stores_fp8

LAYOUTS = ("nhd", "hnd")
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def pool_strides(buffer: torch.Tensor, layout: str, page_size: int) -> tuple[int, tuple[int, int, int, int]]:
    """(slots per addressing page, (page, head, offset, dim) strides) of a pool buffer.

    The same contract as attention/triton_decode.kv_buffer_strides (kept here so this package
    imports nothing from snugkv).
    """
    if layout == "nhd":
        if buffer.dim() != 3:
            raise ValueError(
                f"an 'nhd' KV buffer must be [slots, heads, dim]; got shape {tuple(buffer.shape)}"
            )
        return 1, (buffer.stride(0), buffer.stride(1), 0, buffer.stride(2))
    if layout == "hnd":
        if buffer.dim() != 4 or buffer.shape[2] != page_size:
            raise ValueError(
                f"an 'hnd' KV buffer must be [pages, heads, page_size={page_size}, dim]; "
                f"got shape {tuple(buffer.shape)}"
            )
        return page_size, (buffer.stride(0), buffer.stride(1), buffer.stride(2), buffer.stride(3))
    raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")


def triton_stores_to(buffer: torch.Tensor) -> bool:
    """False when the buffer is fp8 on a GPU whose Triton cannot convert to fp8 (before sm_89):
    the dispatchers then take the torch reference."""
    return buffer.dtype != torch.float8_e4m3fn or stores_fp8(buffer.device)


@triton.jit
def load_slot(Loc, token, Slot_map, HAS_SLOT_MAP: tl.constexpr):
    """The pool slot token `token` writes to, through the window sub-pool map if there is one."""
    slot = tl.load(Loc + token).to(tl.int64)
    if HAS_SLOT_MAP:
        slot = tl.load(Slot_map + slot).to(tl.int64)
    return slot


@triton.jit
def store_head(
    Buf, slot, head, dims, values, mask, stride_page, stride_head, stride_off, stride_dim, PAGE: tl.constexpr
):
    """Write `values` (float32, holding compute-dtype values) at `dims` of (slot, head), cast to
    the buffer's dtype; fp8 buffers saturate to +-448 first."""
    target = Buf + (slot // PAGE) * stride_page + head * stride_head + (slot % PAGE) * stride_off
    storage_dtype = Buf.dtype.element_ty
    if storage_dtype == tl.float8e4nv:
        values = tl.minimum(tl.maximum(values, -448.0), 448.0)
    tl.store(target + dims * stride_dim, values.to(storage_dtype), mask=mask)


@triton.jit
def _store_kv_kernel(
    K,
    V,
    Loc,
    Slot_map,
    KBuf,
    VBuf,
    stride_k_token,
    stride_k_head,
    stride_k_dim,
    stride_v_token,
    stride_v_head,
    stride_v_dim,
    kb_page,
    kb_head,
    kb_off,
    kb_dim,
    vb_page,
    vb_head,
    vb_off,
    vb_dim,
    k_dim,
    v_dim,
    PAGE: tl.constexpr,
    HAS_V: tl.constexpr,
    HAS_SLOT_MAP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = load_slot(Loc, token, Slot_map, HAS_SLOT_MAP)
    dims = tl.arange(0, BLOCK_K)
    mask = dims < k_dim
    k = tl.load(K + token * stride_k_token + head * stride_k_head + dims * stride_k_dim, mask=mask)
    store_head(KBuf, slot, head, dims, k.to(tl.float32), mask, kb_page, kb_head, kb_off, kb_dim, PAGE)
    if HAS_V:
        dims = tl.arange(0, BLOCK_V)
        mask = dims < v_dim
        v = tl.load(V + token * stride_v_token + head * stride_v_head + dims * stride_v_dim, mask=mask)
        store_head(VBuf, slot, head, dims, v.to(tl.float32), mask, vb_page, vb_head, vb_off, vb_dim, PAGE)


def _check_values(buffer: torch.Tensor, values: torch.Tensor, name: str) -> None:
    if values.dim() != 3 or values.shape[1:] != buffer.shape[1:2] + buffer.shape[-1:]:
        raise ValueError(
            f"{name} of shape {tuple(values.shape)} does not match buffer heads/dim {tuple(buffer.shape)}"
        )


def _write_reference(
    buffer: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, layout: str, page_size: int
) -> None:
    pool_strides(buffer, layout, page_size)
    _check_values(buffer, values, "values")
    if buffer.dtype == torch.float8_e4m3fn:
        # Written through a byte view so the indexed copy never depends on fp8 support in index_put_.
        stored = values.clamp(-FP8_MAX, FP8_MAX).to(buffer.dtype).view(torch.uint8)
        target = buffer.view(torch.uint8)
    else:
        stored, target = values.to(buffer.dtype), buffer
    if layout == "nhd":
        target[slots] = stored
    else:
        target[slots // page_size, :, slots % page_size] = stored


def store_kv_reference(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor | None,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    *,
    page_size: int,
    layout: str = "nhd",
    kv_slot_map: torch.Tensor | None = None,
) -> None:
    """attention/triton_store.store_kv in plain torch, with the slot map applied first."""
    slots = kv_slot_map[loc].long() if kv_slot_map is not None else loc
    _write_reference(k_buffer, slots, k, layout, page_size)
    if v is not None:
        if v_buffer is None:
            raise ValueError("v was given but v_buffer is None")
        _write_reference(v_buffer, slots, v, layout, page_size)


def store_kv_triton(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor | None,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    *,
    page_size: int,
    layout: str = "nhd",
    kv_slot_map: torch.Tensor | None = None,
) -> None:
    page, k_strides = pool_strides(k_buffer, layout, page_size)
    _check_values(k_buffer, k, "k")
    if v is not None:
        if v_buffer is None:
            raise ValueError("v was given but v_buffer is None")
        _, v_strides = pool_strides(v_buffer, layout, page_size)
        _check_values(v_buffer, v, "v")
        if v.shape[1] != k.shape[1]:
            raise ValueError(f"k has {k.shape[1]} heads but v has {v.shape[1]}")
    else:
        v_strides = (0, 0, 0, 0)
    if loc.shape != (k.shape[0],):
        raise ValueError(f"loc must be [{k.shape[0]}] (one slot per token); got {tuple(loc.shape)}")
    if k.shape[0] == 0:
        return
    v_dim = v.shape[2] if v is not None else 1
    _store_kv_kernel[(k.shape[0], k.shape[1])](
        k,
        v if v is not None else k,
        loc,
        kv_slot_map if kv_slot_map is not None else loc,
        k_buffer,
        v_buffer if v is not None else k_buffer,
        *k.stride(),
        *(v.stride() if v is not None else (0, 0, 0)),
        *k_strides,
        *v_strides,
        k.shape[2],
        v_dim,
        PAGE=page,
        HAS_V=v is not None,
        HAS_SLOT_MAP=kv_slot_map is not None,
        BLOCK_K=triton.next_power_of_2(k.shape[2]),
        BLOCK_V=triton.next_power_of_2(v_dim),
        num_warps=1 if k.shape[2] <= 256 else 4,
    )


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor | None,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    *,
    page_size: int,
    layout: str = "nhd",
    kv_slot_map: torch.Tensor | None = None,
) -> None:
    """Write k `[n, Hkv, Dk]` (and v `[n, Hkv, Dv]` unless None, e.g. MLA) at slots `loc` (int `[n]`),
    translated through `kv_slot_map` if given, cast to the buffers' dtype. One launch for both."""
    if runs_triton(k) and triton_stores_to(k_buffer):
        store_kv_triton(
            k_buffer, v_buffer, loc, k, v, page_size=page_size, layout=layout, kv_slot_map=kv_slot_map
        )
    else:
        store_kv_reference(
            k_buffer, v_buffer, loc, k, v, page_size=page_size, layout=layout, kv_slot_map=kv_slot_map
        )
