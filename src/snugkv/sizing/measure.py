"""Reading memory: free bytes (MIN over ranks) and the peak of an eager step.

This is the only module that asks a device how much memory is free. With a process group, every
rank gets the MIN over all ranks, so all commit the same token count.

The activation workspace. Before an engine exists (and when it sleeps or closes) a reading settles
first: it synchronizes and empties torch's caching allocator, so cached-but-unused blocks count as
free. A serving engine never empties it: the blocks its largest step used stay in torch's cache,
held for the next step, so a step never asks the driver for memory (another process that takes
every free byte cannot take these). Readings then count those blocks as free for this engine, up to
its activation peak (`workspace_bytes`): they are the headroom it keeps, already in hand.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from snugkv.memory.host_device import SharedHostDevice
from snugkv.memory.vmm import MIB, VirtualMemory

logger = logging.getLogger(__name__)

# Free memory an engine on a GPU leaves to the driver at least (the headroom's margin counts toward
# it), so that another process can start there: create its CUDA context (0.60 GiB with torch on the
# H200, docs/bench/elastic.md; a bare driver context is smaller) and make its first allocations.
# With only the headroom's 256 MiB margin left, a co-tenant's first driver call
# (cuDevicePrimaryCtxRetain) failed with out-of-memory beside a default engine
# (docs/bench/pressure.md), so it could never take memory for the engine to yield. Each MiB beyond
# the margin is KV the engine does not hold (512 MiB: 4,096 tokens of the Llama-3-8B shape).
GUEST_ROOM_BYTES = 768 * MIB


@dataclass(frozen=True, slots=True)
class FreeMemory:
    """Free bytes on this rank and the MIN over every rank (equal with one rank)."""

    local_bytes: int
    min_bytes: int
    per_rank_bytes: tuple[int, ...]
    total_bytes: int


def settle(device: torch.device) -> None:
    """Finish queued work and hand cached allocator blocks back to the device.

    No garbage collection here: tensors die by reference count, and a full collection can
    cost tens of milliseconds on the sizing path.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        _KEPT_UNUSED_BYTES[_device_key(device)] = _reserved_unused_bytes(device)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device after settling; (0, 0) elsewhere (the host backend
    reports its own budget through `VirtualMemory.mem_get_info`)."""
    if device.type != "cuda":
        return 0, 0
    settle(device)
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def torch_reserved_bytes(device: torch.device) -> int:
    """What torch's caching allocator holds on `device` after settling (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    settle(device)
    return int(torch.cuda.memory_reserved(device))


def torch_held_bytes(device: torch.device) -> int:
    """What torch's caching allocator holds on `device` beyond its unused cached blocks (tensors,
    the graphs' pools): read without settling, so a serving engine keeps its workspace (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_reserved(device)) - cached_unused_bytes(device)


def engine_device_bytes(
    memory: VirtualMemory, outside_torch_bytes: int, baseline_reserved_bytes: int = 0
) -> int:
    """Device memory this engine holds now, counted at its sources so other processes never count:
    on CUDA, what torch's allocator holds since the engine's baseline (graph pool, buffers; not
    the activation workspace, which the headroom counts; tensors the process held before the
    engine started are not the engine's) plus what it holds outside torch's allocator (`outside_torch_bytes`: arenas,
    graph executables); on CPU what its backend committed (the KV cache: weights and activations
    live in general RAM)."""
    if memory.device.type == "cuda":
        reserved = torch_held_bytes(memory.device) - baseline_reserved_bytes
        return max(reserved, 0) + outside_torch_bytes
    free, total = memory.mem_get_info()
    return total - free


@dataclass(frozen=True, slots=True)
class CaptureMemory:
    """What capturing the decode graphs took: all of it, and the driver's part outside torch's
    allocator (graph executables, kernel modules loaded while capturing)."""

    total_bytes: int = 0
    driver_bytes: int = 0


def measure_capture(device: torch.device, capture: Callable[[], object]) -> CaptureMemory:
    """Run `capture` and count the device memory it took (nothing off CUDA)."""
    if device.type != "cuda":
        capture()
        return CaptureMemory()
    before, _ = device_memory(device)
    reserved_before = torch.cuda.memory_reserved(device)
    capture()
    after, _ = device_memory(device)
    reserved_growth = torch.cuda.memory_reserved(device) - reserved_before
    return CaptureMemory(before - after, max(before - after - reserved_growth, 0))


def measure_free(
    vmm: VirtualMemory, group: dist.ProcessGroup | None = None, *, workspace_bytes: int | None = None
) -> FreeMemory:
    """Free memory now, agreed over `group` (a CPU/gloo group) by taking the MIN. `workspace_bytes`
    None: settle first (before the engine's workspace exists). A number (a serving engine: its
    activation peak): no synchronize and no emptied cache; the blocks torch's caching allocator
    holds unused count as free, up to that many bytes (the engine's next step takes its
    activations from them; more than its peak is memory it holds, not free)."""
    if workspace_bytes is None:
        settle(vmm.device)
    free, total = vmm.mem_get_info()
    if workspace_bytes is not None:
        free += min(cached_unused_bytes(vmm.device), workspace_bytes)
    per_rank: tuple[int, ...] = (free,)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, torch.tensor([free], dtype=torch.int64), group=group)
        per_rank = tuple(int(value.item()) for value in gathered)
    return FreeMemory(free, min(per_rank), per_rank, total)


def agree_min(value: int, group: dist.ProcessGroup | None = None) -> int:
    """MIN of an integer over `group` (identity without a group)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return int(tensor.item())


def measure_peak_bytes(device: torch.device, step: Callable[[], object]) -> int:
    """Bytes an eager `step` needs beyond what was allocated before it (its activation peak).

    CUDA: torch's peak-allocation counter around the step, plus the growth of reserved
    memory (fragmentation the allocator really keeps). CPU: 0, since activations come from
    general RAM, not from the KV budget.
    """
    if device.type != "cuda":
        step()
        return 0
    settle(device)
    torch.cuda.reset_peak_memory_stats(device)
    base_allocated = torch.cuda.memory_allocated(device)
    base_reserved = torch.cuda.memory_reserved(device)
    step()
    torch.cuda.synchronize(device)
    peak_allocated = torch.cuda.max_memory_allocated(device) - base_allocated
    peak_reserved = torch.cuda.max_memory_reserved(device) - base_reserved
    return max(peak_allocated, peak_reserved, 0)


def shared_device_free_bytes(device: torch.device) -> int | None:
    """Free bytes of the device several processes share, before an engine exists on it: the GPU's
    (after settling), or the host backend's shared simulated device (None when there is none)."""
    if device.type == "cuda":
        return device_memory(device)[0]
    shared = SharedHostDevice.from_env()
    return None if shared is None else shared.free_bytes()


# Per device: the blocks torch's allocator holds unused right after the last `settle`, i.e. those
# emptying the cache cannot hand back. They are the CUDA graphs' private pools, whose free blocks
# only their graphs' replays use (decode graphs up to batch 256 of the Mixtral-8x7B shape: enough
# that counting them as free made memory pressure try to grow the KV cache by 1 GiB into memory the
# driver did not have, H200 at 69b276b), and partly used segments. Neither is memory a KV grow can
# back, so `cached_unused_bytes` counts only what is unused beyond them.
_KEPT_UNUSED_BYTES: dict[tuple[str, int], int] = {}


def _device_key(device: torch.device) -> tuple[str, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return device.type, int(index)


def _reserved_unused_bytes(device: torch.device) -> int:
    return max(int(torch.cuda.memory_reserved(device)) - int(torch.cuda.memory_allocated(device)), 0)


def cached_unused_bytes(device: torch.device) -> int:
    """Bytes torch's caching allocator holds that no tensor uses (between steps: the activations of
    the last one), beyond what it held unused after the last `settle` (the graphs' private pools).
    They are free for this process's next step, so they count toward its own headroom; reading the
    counters needs no synchronization (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    kept = _KEPT_UNUSED_BYTES.get(_device_key(device), 0)
    return max(_reserved_unused_bytes(device) - kept, 0)
