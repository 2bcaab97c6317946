"""Test-side paged KV pools and a dense float64 attention reference for the Triton kernels.

Pools follow docs/ARCHITECTURE.md: page 0 is the dummy page, usable slots are [P, P + N), the
table holds slot indices, and row 0 of the table is the padding row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The small tests run where the kernels do: the Triton interpreter on CPU, the GPU when there is one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True, slots=True)
class PagedKV:
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    page_size: int
    layout: str
    kv_slot_map: torch.Tensor | None  # full-pool slot -> slot of the buffers above, or None


def make_kv_buffers(
    gen: torch.Generator,
    *,
    num_slots: int,
    page_size: int,
    layout: str,
    num_kv_heads: int,
    k_dim: int,
    v_dim: int,
    dtype: torch.dtype,
    mla: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K/V buffers on the generator's device; with `mla` the value buffer is a strided view
    of the key buffer's first columns."""
    if layout == "nhd":
        shape = (num_slots, num_kv_heads)
    else:
        shape = (num_slots // page_size, num_kv_heads, page_size)
    k = torch.randn(*shape, k_dim, generator=gen, device=gen.device).to(dtype)
    if mla:
        return k, k[..., :v_dim]
    v = torch.randn(*shape, v_dim, generator=gen, device=gen.device).to(dtype)
    return k, v


def scattered_slots(
    gen: torch.Generator, lengths: list[int], page_size: int, num_tokens: int
) -> list[torch.Tensor]:
    """Give each request its slots from one random permutation of the usable slots [P, P + N)."""
    usable = torch.randperm(num_tokens, generator=gen) + page_size
    rows, start = [], 0
    for length in lengths:
        rows.append(usable[start : start + length])
        start += length
    return rows


def make_table(
    gen: torch.Generator, slot_rows: list[torch.Tensor], max_context: int, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(req_to_token int32 [num_rows, max_context], req_pool_indices int32) with rows picked at random, never row 0."""
    table = torch.zeros(num_rows, max_context, dtype=torch.int32)
    req_pool_indices = (torch.randperm(num_rows - 1, generator=gen)[: len(slot_rows)] + 1).to(torch.int32)
    for req, slots in zip(req_pool_indices.tolist(), slot_rows):
        table[req, : len(slots)] = slots.to(torch.int32)
    return table, req_pool_indices


def gather_kv(buffer: torch.Tensor, slots: torch.Tensor, layout: str, page_size: int) -> torch.Tensor:
    """[n, heads, dim] float64 rows of `slots` (already translated through any slot map)."""
    slots = slots.long().to(buffer.device)
    # Index fp8 through a byte view: not every torch build indexes float8 tensors.
    source = buffer.view(torch.uint8) if buffer.element_size() == 1 else buffer
    rows = source[slots] if layout == "nhd" else source[slots // page_size, :, slots % page_size]
    return rows.view(buffer.dtype).to(torch.float64)


def pool_rows(pool: PagedKV, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if pool.kv_slot_map is not None:
        slots = pool.kv_slot_map.long()[slots.long().to(pool.kv_slot_map.device)]
    return (
        gather_kv(pool.k_buffer, slots, pool.layout, pool.page_size),
        gather_kv(pool.v_buffer, slots, pool.layout, pool.page_size),
    )


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    sm_scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """float64 softmax attention: q [m, Hq, Dk], k [n, Hkv, Dk], v [n, Hkv, Dv]; key i sits at position i."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.double().to(k.device), k) * sm_scale
    key_positions = torch.arange(k.shape[0], device=k.device)
    qp = q_positions.long().to(k.device)[:, None]
    allowed = key_positions[None, :] <= qp
    if sliding_window is not None:
        allowed &= qp - key_positions[None, :] < sliding_window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", scores.softmax(dim=-1), v)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual = actual.double().cpu()
    expected = expected.double().cpu()
    assert not torch.isnan(actual).any(), "kernel output holds NaN"
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()
