"""What a shrink's decommit costs per chunk, and whether fewer driver calls can do it (issue 36: a
10 GiB shrink of 8 MiB chunks took 56 ms on an H100, 1,280 unmaps + releases).

Commits `--chunks` chunks of `--chunk-mib` side by side in one reserved range, then decommits them
three ways, each timed: (1) unmap + release each (today's `decommit`); (2) handles released right
after mapping (the memory lives while mapped), then unmap each; (3) one `cuMemUnmap` over the span of
`--span` adjacent mappings (does the driver take a range over several mappings?). Prints one JSON
line per way.
Run on the device: `python3 scripts/vmm_unmap_probe.py`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from cuda.bindings import driver as drv


def ok(result, call: str):
    error = result[0] if isinstance(result, tuple) else result
    if error != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{call}: {error}")
    return result[1] if isinstance(result, tuple) and len(result) > 1 else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=1280)
    parser.add_argument("--span", type=int, default=16)
    args = parser.parse_args()
    torch.zeros(1, device="cuda")  # the primary context
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = torch.cuda.current_device()
    access = drv.CUmemAccessDesc()
    access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = prop.location.id
    access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    chunk = args.chunk_mib << 20
    total = chunk * args.chunks
    base = int(ok(drv.cuMemAddressReserve(total, 2 << 20, 0, 0), "cuMemAddressReserve"))

    def commit(release_now: bool) -> list:
        handles = []
        started = time.perf_counter()
        for index in range(args.chunks):
            handle = ok(drv.cuMemCreate(chunk, prop, 0), "cuMemCreate")
            ok(drv.cuMemMap(base + index * chunk, chunk, 0, handle, 0), "cuMemMap")
            if release_now:
                ok(drv.cuMemRelease(handle), "cuMemRelease")
            handles.append(handle)
        ok(drv.cuMemSetAccess(base, total, [access], 1), "cuMemSetAccess")
        torch.cuda.synchronize()
        return [handles, (time.perf_counter() - started) * 1e3]

    def report(way: str, commit_ms: float, started: float, **more) -> None:
        torch.cuda.synchronize()
        ms = (time.perf_counter() - started) * 1e3
        free = torch.cuda.mem_get_info()[0]
        print(json.dumps({"way": way, "chunk_mib": args.chunk_mib, "chunks": args.chunks, "commit_ms": round(commit_ms, 1),
                          "decommit_ms": round(ms, 1), "us_per_chunk": round(ms * 1e3 / args.chunks, 1),
                          "free_gib_after": round(free / 2**30, 2), **more}), flush=True)  # fmt: skip

    handles, commit_ms = commit(release_now=False)
    started = time.perf_counter()
    for index, handle in enumerate(handles):
        ok(drv.cuMemUnmap(base + index * chunk, chunk), "cuMemUnmap")
        ok(drv.cuMemRelease(handle), "cuMemRelease")
    report("unmap+release each", commit_ms, started)

    handles, commit_ms = commit(release_now=True)
    started = time.perf_counter()
    for index in range(args.chunks):
        ok(drv.cuMemUnmap(base + index * chunk, chunk), "cuMemUnmap")
    report("released at map, unmap each", commit_ms, started)

    handles, commit_ms = commit(release_now=True)
    started = time.perf_counter()
    result = "ok"
    try:
        for first in range(0, args.chunks, args.span):
            count = min(args.span, args.chunks - first)
            ok(drv.cuMemUnmap(base + first * chunk, count * chunk), "cuMemUnmap(span)")
    except RuntimeError as error:
        result = str(error)
        for index in range(args.chunks):  # what is left, one mapping at a time
            drv.cuMemUnmap(base + index * chunk, chunk)
    report(f"released at map, one unmap per {args.span} mappings", commit_ms, started, result=result)
    ok(drv.cuMemAddressFree(base, total), "cuMemAddressFree")


if __name__ == "__main__":
    main()
