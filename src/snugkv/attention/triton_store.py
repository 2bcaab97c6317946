"""Write new K/V rows into a paged pool buffer, in either layout, casting to the storage dtype.

Token-major "nhd" `[slots, Hkv, D]` takes row `loc`; page-major "hnd" `[pages, Hkv, P, D]` takes
`[loc // P, :, loc % P]` (docs/ARCHITECTURE.md). fp8 (e4m3fn, scale 1) storage saturates to
+-448 instead of turning out-of-range values into NaN, and is written through a uint8 view so
the indexed copy never depends on fp8 support in `index_put_`.

This is plain torch indexing: no host sync and shapes fixed by `loc`, so it can sit inside a
captured CUDA graph. It must never loop over slots in Python or read `loc` on the host.
MLA pools pass `v=None`: the value buffer is a view of the latent key buffer, written with it.
"""

from __future__ import annotations

import torch

from snugkv.kernels.kv_store import pool_strides

_FP8_MAX = {torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max}


def _to_storage(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype in _FP8_MAX:
        limit = _FP8_MAX[dtype]
        return values.clamp(-limit, limit).to(dtype).view(torch.uint8)
    return values.to(dtype)


def _write(
    buffer: torch.Tensor, loc: torch.Tensor, values: torch.Tensor, layout: str, page_size: int
) -> None:
    pool_strides(buffer, layout, page_size)  # validates the layout and shape
    if values.shape[1:] != buffer.shape[1:2] + buffer.shape[-1:]:
        raise ValueError(
            f"values of shape {tuple(values.shape)} do not match buffer heads/dim {tuple(buffer.shape)}"
        )
    stored = _to_storage(values, buffer.dtype)
    target = buffer.view(torch.uint8) if buffer.dtype in _FP8_MAX else buffer
    if layout == "nhd":
        target[loc] = stored
    else:
        target[loc // page_size, :, loc % page_size] = stored


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor | None,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    *,
    page_size: int,
    layout: str = "nhd",
) -> None:
    """Write k [n, Hkv, Dk] (and v [n, Hkv, Dv] unless None) at slots `loc` (int64 [n])."""
    _write(k_buffer, loc, k, layout, page_size)
    if v is not None:
        if v_buffer is None:
            raise ValueError("v was given but v_buffer is None")
        _write(v_buffer, loc, v, layout, page_size)
