"""The co-tenant of `snugkv bench pressure`: another process that takes device memory with plain
CUDA driver calls (`cuMemAlloc`, `cuMemFree` through `cuda.bindings.driver`: no torch, no caching
allocator, nothing of snugkv's), as any other program on the GPU would.

`python -m snugkv.bench.pressure_hog --device cuda|cpu` reads one command a line from stdin and
answers each with one JSON line:
- `all-but BYTES`: one allocation of everything the driver says is free but BYTES;
- `grow STEP EVERY_MS LIMIT`: an allocation of STEP bytes every EVERY_MS ms until it holds LIMIT
  (a step the driver refuses is counted and tried again at the next tick);
- `free`: frees everything it holds at once.
Each answer has `held_bytes`, `failed_allocations`, the driver's `free_bytes` after, and `ms`.
On a CPU the memory is a holding on the simulated shared device (`memory.host_device`), which the
server's host backend commits against.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


class CudaMemory:
    """Device memory through the CUDA driver API on the primary context of device 0."""

    def __init__(self) -> None:
        from cuda.bindings import driver as drv

        self.drv = drv
        self._check(drv.cuInit(0))
        device = self._check(drv.cuDeviceGet(0))
        context = self._check(drv.cuDevicePrimaryCtxRetain(device))
        self._check(drv.cuCtxSetCurrent(context))
        self.blocks: list[tuple[Any, int]] = []

    def _check(self, result: tuple) -> Any:
        error, *values = result
        if error != self.drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver error {error}")
        return values[0] if len(values) == 1 else values

    def free_bytes(self) -> int:
        free, _total = self._check(self.drv.cuMemGetInfo())
        return int(free)

    def allocate(self, size_bytes: int) -> bool:
        error, pointer = self.drv.cuMemAlloc(size_bytes)
        if error != self.drv.CUresult.CUDA_SUCCESS:
            return False
        self.blocks.append((pointer, size_bytes))
        return True

    def free_all(self) -> None:
        for pointer, _size in self.blocks:
            self.drv.cuMemFree(pointer)
        self.blocks.clear()


class SharedHostMemory:
    """The simulated device that `SNUGKV_HOST_DEVICE_GIB` describes (a CPU run's stand-in)."""

    def __init__(self) -> None:
        from snugkv.memory.host_device import HOST_DEVICE_ENV, SharedHostDevice

        device = SharedHostDevice.from_env()
        if device is None:
            raise SystemExit(
                f"the CPU co-tenant needs {HOST_DEVICE_ENV} set (the simulated device it shares)"
            )
        self.device = device
        self.blocks: list[tuple[None, int]] = []

    def free_bytes(self) -> int:
        return self.device.free_bytes()

    def allocate(self, size_bytes: int) -> bool:
        if self.device.take(size_bytes) < size_bytes:
            return False
        self.blocks.append((None, size_bytes))
        return True

    def free_all(self) -> None:
        self.device.give_back(sum(size for _, size in self.blocks))
        self.blocks.clear()


def serve(memory: CudaMemory | SharedHostMemory) -> None:
    print(json.dumps({"ready": True, "free_bytes": memory.free_bytes()}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        started = time.perf_counter()
        failed = 0
        if words[0] == "all-but":
            want = memory.free_bytes() - int(words[1])
            if want > 0 and not memory.allocate(want):
                failed += 1
        elif words[0] == "grow":
            step, every_s, limit = int(words[1]), float(words[2]) / 1e3, int(words[3])
            tick = time.perf_counter()
            while sum(size for _, size in memory.blocks) + step <= limit:
                if not memory.allocate(step):
                    failed += 1
                tick += every_s
                time.sleep(max(tick - time.perf_counter(), 0.0))
        elif words[0] == "free":
            memory.free_all()
        else:
            print(json.dumps({"error": f"unknown command {words[0]!r}"}), flush=True)
            continue
        answer = {
            "command": words[0],
            "held_bytes": sum(size for _, size in memory.blocks),
            "allocations": len(memory.blocks),
            "failed_allocations": failed,
            "free_bytes": memory.free_bytes(),
            "ms": round((time.perf_counter() - started) * 1e3, 1),
        }
        print(json.dumps(answer), flush=True)
    memory.free_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    args = parser.parse_args()
    serve(CudaMemory() if args.device == "cuda" else SharedHostMemory())


if __name__ == "__main__":
    main()
