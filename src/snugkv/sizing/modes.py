"""Sizing modes and the two classic (pre-capture) formulas kept for comparison and fallback.

- post-capture: measure after graph capture, back exactly what fits (the default where VMM works).
- profiled: profile the largest eager step, then size KV *before* capture from
  `gpu_memory_utilization` (graph memory is not known yet, so it comes out of the margin).
- static-fraction: a fixed `mem_fraction_static` of total memory for weights + KV, with the
  rest reserved by a heuristic for graphs and activations.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum

import torch

from snugkv.memory.vmm import GIB
from snugkv.memory.vmm_factory import cuda_vmm_status

logger = logging.getLogger(__name__)


class SizingMode(StrEnum):
    POST_CAPTURE = "post-capture"
    PROFILED = "profiled"
    STATIC_FRACTION = "static-fraction"


def resolve_mode(requested: SizingMode | str | None, device: torch.device) -> SizingMode:
    """The mode to run: the requested one, or post-capture, falling back to profiled with one log line."""
    mode = SizingMode(requested) if requested else SizingMode.POST_CAPTURE
    if mode is not SizingMode.POST_CAPTURE or device.type == "cpu":
        return mode  # CPU runs post-capture over the host backend
    ok, reason = cuda_vmm_status(device)
    if not ok:
        logger.warning(
            "Post-capture KV sizing unavailable (%s); falling back to --kv-sizing profiled.", reason
        )
        return SizingMode.PROFILED
    return mode


def profiled_kv_budget_bytes(
    *, total_bytes: int, used_bytes: int, activation_peak_bytes: int, gpu_memory_utilization: float
) -> int:
    """KV bytes under the profiled formula: a utilisation share of the device, less what is
    used now (weights, context) and the profiled activation peak. Graphs are captured later,
    out of the `1 - gpu_memory_utilization` margin."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    return int(total_bytes * gpu_memory_utilization) - used_bytes - activation_peak_bytes


@dataclass(frozen=True, slots=True)
class StaticFraction:
    mem_fraction_static: float
    reserve_bytes: int  # what the heuristic leaves for graphs and activations
    kv_budget_bytes: int


def static_fraction_budget(
    *,
    total_bytes: int,
    used_bytes: int,
    chunked_prefill_tokens: int,
    max_graph_batch: int,
    mem_fraction_static: float | None = None,
) -> StaticFraction:
    """KV bytes under the classic fixed-fraction rule.

    The default fraction reserves, for graphs and activations, a heuristic amount that grows
    with the prefill chunk and the largest graph batch (snugkv's own rule, in the spirit of the
    knobs other engines ship): 1 GiB + 1.5 GiB per 8192 chunk tokens + 1 GiB per 256 graph rows,
    plus 3% of the device for fragmentation.
    """
    if mem_fraction_static is None:
        reserve = int(
            GIB + 1.5 * GIB * chunked_prefill_tokens / 8192 + GIB * max_graph_batch / 256 + 0.03 * total_bytes
        )
        mem_fraction_static = 1 - reserve / total_bytes
    elif not 0 < mem_fraction_static < 1:
        raise ValueError(f"--mem-fraction-static must be in (0, 1), got {mem_fraction_static}")
    reserve = total_bytes - int(total_bytes * mem_fraction_static)
    budget = int(total_bytes * mem_fraction_static) - used_bytes
    return StaticFraction(mem_fraction_static, reserve, budget)


def static_kv_tokens(
    budget_bytes: int, bytes_per_token: float, page_size: int, max_total_tokens: int | None
) -> int:
    """Tokens a classic pool gets from its byte budget: whole pages, one page less for the dummy
    page, capped by the user's `--max-total-tokens` (may be <= 0: no room)."""
    tokens = int(budget_bytes // bytes_per_token) // page_size * page_size - page_size
    if max_total_tokens:
        tokens = min(tokens, max_total_tokens // page_size * page_size)
    return tokens
