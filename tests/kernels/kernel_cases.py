"""Shared helpers for the fused-kernel tests: the device they run on, tolerances, KV pools."""

from __future__ import annotations

import torch

# The kernels run where the tests do: the Triton interpreter on CPU, the GPU when there is one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"

# Bands for results whose float32 reductions (sum of squares, exp, erf) may differ in the last bit:
# a last-bit change in float32 can flip one rounding of the 16-bit output.
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
}


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random values made on the CPU generator (the same on every device), then moved."""
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def pool_buffer(
    gen: torch.Generator,
    *,
    num_slots: int,
    num_kv_heads: int,
    head_dim: int,
    layout: str,
    page_size: int,
    dtype: torch.dtype,
    padded: bool = False,
) -> torch.Tensor:
    """A random KV buffer in the pool's layout; `padded` makes it a non-contiguous view of a wider
    allocation (pool buffers are arena views, and strides must be honoured)."""
    extra = 8 if padded else 0
    if layout == "nhd":
        shape = (num_slots, num_kv_heads, head_dim + extra)
    else:
        shape = (num_slots // page_size, num_kv_heads, page_size, head_dim + extra)
    full = torch.randn(*shape, generator=gen).clamp(-4, 4).to(dtype).to(DEVICE)
    return full[..., :head_dim]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def scattered_slots(gen: torch.Generator, num_tokens: int, num_slots: int, page_size: int) -> torch.Tensor:
    """Distinct slots outside the dummy page, in random order, int64."""
    return (torch.randperm(num_slots - page_size, generator=gen)[:num_tokens] + page_size).to(DEVICE)
