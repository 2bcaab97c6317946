"""Which virtual-memory backend a device gets: CUDA VMM on a GPU, the mmap backend on CPU.

Kept apart from the interface (vmm.py) so that the backends import the interface and this module
imports the backends, never the other way round.
"""

from __future__ import annotations

from typing import Any

import torch

from snugkv.memory.vmm import VirtualMemory, VmmUnavailable
from snugkv.memory.vmm_host import HostVmm


def cuda_vmm_status(device: torch.device | None = None) -> tuple[bool, str]:
    """Whether CUDA VMM works on `device`, and a sentence saying why not."""
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible"
    try:
        from snugkv.memory.vmm_cuda import probe_vmm_support  # needs cuda-bindings
    except ImportError as exc:  # cuda-bindings missing or broken
        return False, f"cuda.bindings is not importable ({exc}); install cuda-bindings"
    return probe_vmm_support(device or torch.device("cuda", torch.cuda.current_device()))


def create_vmm(device: torch.device | str, **host_options: Any) -> VirtualMemory:
    """The backend for `device`: CUDA VMM on a GPU, the mmap backend on CPU.

    Raises `VmmUnavailable` with the reason when a GPU cannot do VMM, so the caller can
    fall back to static sizing and say so.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return HostVmm(**host_options)
    if device.type != "cuda":
        raise VmmUnavailable(f"no virtual-memory backend for device type {device.type!r}")
    ok, reason = cuda_vmm_status(device)
    if not ok:
        raise VmmUnavailable(reason)
    from snugkv.memory.vmm_cuda import CudaVmm  # imports cuda.bindings: only where a GPU is

    return CudaVmm(device)
