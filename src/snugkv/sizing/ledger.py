"""The memory ledger: where the device's memory went, from independent counts.

Items are counted at their source, not derived from one another: weights from the
parameters, KV from the arena's committed extensions, graphs and buffers from torch's
allocator, the baseline (CUDA context, other processes) from free memory before the engine
allocated anything. Their sum is compared with what the device says is used; `unaccounted`
is the difference and should stay within a few hundred MiB.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from snugkv.memory.vmm import GIB, VirtualMemory
from snugkv.sizing.measure import device_memory


@dataclass(frozen=True, slots=True)
class MemoryLedger:
    device: str
    total_bytes: int
    free_bytes: int
    baseline_bytes: int  # used before the engine started: CUDA context, other processes
    weights_bytes: int
    graphs_and_buffers_bytes: int  # torch allocator minus weights: graph pool, persistent buffers
    kv_committed_bytes: int
    kv_reserved_va_bytes: int  # address space only, not memory
    activation_peak_bytes: int  # measured peak of the largest eager step
    headroom_bytes: int  # memory left free on purpose: activation peak plus the stated margin
    weights_in_device_memory: bool = True  # False on CPU (general RAM) and while the weights sleep
    graph_executables_bytes: int = 0  # driver memory taken while capturing, outside torch's allocator

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.free_bytes

    @property
    def accounted_bytes(self) -> int:
        weights = self.weights_bytes if self.weights_in_device_memory else 0
        return (
            self.baseline_bytes
            + weights
            + self.graphs_and_buffers_bytes
            + self.graph_executables_bytes
            + self.kv_committed_bytes
        )

    @property
    def unaccounted_bytes(self) -> int:
        return self.used_bytes - self.accounted_bytes

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("baseline (context, other processes)", self.baseline_bytes),
            (
                "weights" + ("" if self.weights_in_device_memory else " (host RAM, not in the KV budget)"),
                self.weights_bytes,
            ),
            ("graphs and buffers (torch allocator)", self.graphs_and_buffers_bytes),
            ("graph executables and modules (driver)", self.graph_executables_bytes),
            ("KV committed", self.kv_committed_bytes),
            ("unaccounted", self.unaccounted_bytes),
            ("free (headroom kept for activations)", self.free_bytes),
            ("= total", self.total_bytes),
            ("activation peak, measured", self.activation_peak_bytes),
            ("headroom target (peak + margin)", self.headroom_bytes),
            ("KV virtual address space reserved", self.kv_reserved_va_bytes),
        ]

    def table(self) -> str:
        width = max(len(name) for name, _ in self.rows())
        lines = [f"Memory ledger ({self.device}):"]
        lines += [f"  {name:<{width}}  {value / GIB:9.3f} GiB" for name, value in self.rows()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, int | str | bool]:
        data: dict[str, int | str | bool] = asdict(self)
        data.update(
            used_bytes=self.used_bytes,
            accounted_bytes=self.accounted_bytes,
            unaccounted_bytes=self.unaccounted_bytes,
        )
        return data


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
    headroom_bytes: int,
) -> MemoryLedger:
    """The ledger as the device reports it now.

    On CUDA, torch's reserved memory minus the weights (and minus the KV cache when it came from
    torch's allocator, as in the static modes) is the graph pool and persistent buffers; the
    baseline is what was used before the engine allocated anything. On CPU the host backend's
    budget stands for the device, and weights live in general RAM.
    """
    if device.type == "cuda":
        free, total = device_memory(device)
        baseline = total - baseline_free_bytes
        kv_in_torch = kv_committed_bytes if kv_in_torch_allocator else 0
        weights_in_torch = weights_bytes if weights_in_torch_allocator else 0
        graphs_and_buffers = torch.cuda.memory_reserved(device) - weights_in_torch - kv_in_torch
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
        headroom_bytes=headroom_bytes,
        weights_in_device_memory=device.type == "cuda" and weights_resident,
    )
