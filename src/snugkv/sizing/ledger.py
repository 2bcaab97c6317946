"""Measuring the memory ledger (`core.reports.MemoryLedger`): where the device's memory went, from
independent counts.

Items are counted at their source, not derived from one another: weights from the
parameters, KV from the arena's committed extensions, graphs and buffers from torch's
allocator, the baseline (CUDA context, other processes) from free memory before the engine
allocated anything. Their sum is compared with what the device says is used; `unaccounted`
is the difference and should stay within a few hundred MiB.
"""

from __future__ import annotations

import torch

from snugkv.core.reports import MemoryLedger
from snugkv.memory.vmm import VirtualMemory
from snugkv.sizing.measure import cached_unused_bytes

__all__ = ["MemoryLedger", "measure_ledger"]  # the ledger's type is core's; this module measures it


def measure_ledger(
    device: torch.device,
    memory: VirtualMemory,
    *,
    baseline_free_bytes: int,
    weights_bytes: int,
    kv_committed_bytes: int,
    kv_reserved_va_bytes: int,
    kv_in_torch_allocator: bool,
    weights_in_torch_allocator: bool = True,
    weights_resident: bool = True,
    graph_executables_bytes: int,
    activation_peak_bytes: int,
    verify_peak_bytes: int = 0,
    draft_model: str = "",
    draft_peak_bytes: int = 0,
    draft_weights_bytes: int = 0,
    draft_kv_bytes_per_token: int = 0,
    headroom_bytes: int,
    guest_room_bytes: int = 0,
    host_tier_staging_bytes: int = 0,
) -> MemoryLedger:
    """The ledger as the device reports it now.

    On CUDA, torch's reserved memory minus the weights (and minus the KV cache when it came from
    torch's allocator, as in the static modes) and minus its unused cached blocks (the activation
    workspace, a row of its own, and the host tier's copy staging, another) is the graph pool and
    persistent buffers; the baseline is what was used before the engine allocated anything. Read
    without settling: a serving engine keeps its workspace. On CPU the host backend's budget stands
    for the device, and weights and the staging live in general RAM (no row).
    """
    workspace = 0
    staging = host_tier_staging_bytes if device.type == "cuda" else 0
    if device.type == "cuda":
        free, total = (int(value) for value in torch.cuda.mem_get_info(device))
        baseline = total - baseline_free_bytes
        kv_in_torch = kv_committed_bytes if kv_in_torch_allocator else 0
        weights_in_torch = weights_bytes if weights_in_torch_allocator else 0
        workspace = cached_unused_bytes(device)
        graphs_and_buffers = (
            torch.cuda.memory_reserved(device) - workspace - weights_in_torch - kv_in_torch - staging
        )
        name = torch.cuda.get_device_name(device)
    else:
        free, total = memory.mem_get_info()
        baseline, graphs_and_buffers, name = 0, 0, "cpu (host backend)"
    return MemoryLedger(
        device=name,
        total_bytes=total,
        free_bytes=free,
        baseline_bytes=baseline,
        weights_bytes=weights_bytes,
        graphs_and_buffers_bytes=graphs_and_buffers,
        graph_executables_bytes=graph_executables_bytes,
        kv_committed_bytes=kv_committed_bytes,
        kv_reserved_va_bytes=kv_reserved_va_bytes,
        activation_peak_bytes=activation_peak_bytes,
        verify_peak_bytes=verify_peak_bytes,
        draft_model=draft_model,
        draft_peak_bytes=draft_peak_bytes,
        draft_weights_bytes=draft_weights_bytes,
        draft_kv_bytes_per_token=draft_kv_bytes_per_token,
        headroom_bytes=headroom_bytes,
        weights_in_device_memory=device.type == "cuda" and weights_resident,
        workspace_bytes=workspace,
        guest_room_bytes=guest_room_bytes,
        host_tier_staging_bytes=staging,
    )
