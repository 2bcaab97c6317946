"""Plain-allocation backend: static pools on devices without VMM (and for static modes).

`reserve` allocates the whole range for real through torch's allocator; `commit` and
`decommit` only check alignment, since everything is already backed. With it, a static KV pool
goes through the same arena, views and pool code as a post-capture one; only the memory
behind it differs. This is the fallback when CUDA VMM is unavailable.
"""

from __future__ import annotations

import torch

from snugkv.memory.vmm import MIB, CommitError, Extension, VirtualMemory


class PlainMemory(VirtualMemory):
    name = "plain"

    def __init__(self, device: torch.device | str, granularity_bytes: int = 2 * MIB) -> None:
        self.device = torch.device(device)
        self._granularity_bytes = granularity_bytes
        self._blocks: dict[int, torch.Tensor] = {}

    @property
    def granularity_bytes(self) -> int:
        return self._granularity_bytes

    def mem_get_info(self) -> tuple[int, int]:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return int(free), int(total)
        from snugkv.memory.vmm_host import available_ram_bytes

        available = available_ram_bytes()
        return available, available

    def reserve(self, size_bytes: int) -> int:
        try:
            block = torch.empty(self.align_up(size_bytes), dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError as exc:
            raise CommitError(
                f"allocating {size_bytes / 2**30:.2f} GiB for a static KV pool failed: {exc}"
            ) from exc
        self._blocks[block.data_ptr()] = block
        return block.data_ptr()

    def commit(self, address: int, size_bytes: int) -> Extension:
        return Extension(address, size_bytes, handle=None)

    def decommit(self, extension: Extension) -> None:
        return None

    def release(self, address: int, size_bytes: int) -> None:
        self._blocks.pop(address, None)
