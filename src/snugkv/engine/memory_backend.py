"""Where the engine's memory comes from: the backend the KV cache is placed in (virtual memory on
the device, an mmap-backed host device on CPU, plain torch memory for the static modes), the
weights' own backend, and the host's sizes (its KV capacity, the headroom a simulated shared
device keeps).

Chosen once at start-up from the device, the sizing mode and the flags; this module never sizes
nor allocates the KV cache itself.
"""

from __future__ import annotations

import torch

from snugkv.engine.args import EngineArgs
from snugkv.memory.host_device import SharedHostDevice
from snugkv.memory.vmm import GIB, VirtualMemory
from snugkv.memory.vmm_factory import create_vmm
from snugkv.memory.vmm_host import HostVmm, available_ram_bytes
from snugkv.memory.vmm_plain import PlainMemory
from snugkv.sizing.modes import SizingMode


def memory_backend(device: torch.device, mode: SizingMode, args: EngineArgs) -> VirtualMemory:
    """The KV cache's memory: post-capture places it in virtual memory, the static modes in plain
    memory; on CPU a host device (SNUGKV_HOST_DEVICE_GIB: one simulated device shared with other
    processes, multi-engine)."""
    if device.type == "cpu":
        return HostVmm(capacity_bytes=_host_kv_bytes(args), shared=SharedHostDevice.from_env())
    if mode is SizingMode.POST_CAPTURE:
        return create_vmm(device)
    return PlainMemory(device)


def weights_memory(device: torch.device, mode: SizingMode) -> VirtualMemory | None:
    """Virtual memory for the weights where the KV cache has it too (post-capture); on CPU an
    mmap backend of its own, so the weights never count against the KV budget."""
    if mode is not SizingMode.POST_CAPTURE:
        return None
    return HostVmm() if device.type == "cpu" else create_vmm(device)


def host_headroom_bytes() -> int:
    """The host keeps no activation headroom (activations come from general RAM), except on a
    simulated shared device told to keep some (memory-pressure tests)."""
    shared = SharedHostDevice.from_env()
    return shared.headroom_bytes if shared is not None else 0


def _host_kv_bytes(args: EngineArgs) -> int:
    if args.memory.host_kv_gib is not None:
        return int(args.memory.host_kv_gib * GIB)
    return min(GIB, available_ram_bytes() // 4)
