"""`snugkv bench vmm`: commit and decommit throughput of the VMM backends.

For each size: one extension for the whole span (how snugkv commits) against one extension
per granule-sized chunk (the naive loop); then the finalize of a whole KV pool at the scale
the device allows (Llama-3-8B shape: 32 layers x K and V, 8 KV heads, head_dim 128, bf16),
which is the step post-capture sizing adds to start-up.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from snugkv.bench.harness import emit
from snugkv.memory.arena import KvArena
from snugkv.memory.kv_pool import KVPoolSpec, MHAKVPool
from snugkv.memory.vmm import GIB, MIB, VirtualMemory, VmmUnavailable
from snugkv.memory.vmm_factory import create_vmm

CHUNK_BYTES = 2 * MIB


def _sync(vmm: VirtualMemory) -> None:
    if vmm.device.type == "cuda":
        torch.cuda.synchronize(vmm.device)


def _time_commit(vmm: VirtualMemory, size_bytes: int, chunk_bytes: int | None) -> tuple[float, float]:
    """Milliseconds to commit and to decommit `size_bytes`, whole or in chunks."""
    base = vmm.reserve(size_bytes)
    step = chunk_bytes or size_bytes
    try:
        _sync(vmm)
        start = time.perf_counter()
        extensions = [vmm.commit(base + offset, step) for offset in range(0, size_bytes, step)]
        _sync(vmm)
        commit_ms = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        for extension in reversed(extensions):
            vmm.decommit(extension)
        _sync(vmm)
        decommit_ms = (time.perf_counter() - start) * 1e3
    finally:
        vmm.release(base, size_bytes)
    return commit_ms, decommit_ms


def _pool_finalize(vmm: VirtualMemory, pool_bytes: int) -> dict[str, Any]:
    bytes_per_token = 32 * 2 * 8 * 128 * 2
    tokens = pool_bytes // bytes_per_token
    arena = KvArena(vmm, pool_bytes + 256 * MIB, label="bench")
    pool = MHAKVPool(
        KVPoolSpec.of(dtype="bfloat16", page_size=1, layout="nhd", device=vmm.device, mode="post-capture"),
        reserved_tokens=tokens + 1024,
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        arena=arena,
    )
    pool.ensure_prefix()
    _sync(vmm)
    start = time.perf_counter()
    pool.finalize_backing(tokens)
    _sync(vmm)
    finalize_ms = (time.perf_counter() - start) * 1e3
    committed = pool.committed_bytes
    start = time.perf_counter()
    pool.close()
    arena.close()
    release_ms = (time.perf_counter() - start) * 1e3
    return {
        "backend": vmm.name,
        "case": "pool finalize (64 buffers)",
        "size_gib": round(committed / GIB, 2),
        "commit_ms": finalize_ms,
        "decommit_ms": release_ms,
        "commit_gib_per_s": committed / GIB / (finalize_ms / 1e3),
    }


def run_backend(vmm: VirtualMemory, sizes_gib: list[float], pool_gib: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    free_bytes, _ = vmm.mem_get_info()
    for size_gib in sizes_gib:
        size_bytes = int(size_gib * GIB)
        if size_bytes > free_bytes * 0.9:
            print(f"skip {size_gib} GiB on {vmm.name}: only {free_bytes / GIB:.1f} GiB free")
            continue
        for label, chunk in (("one extension", None), (f"{CHUNK_BYTES // MIB} MiB chunks", CHUNK_BYTES)):
            commit_ms, decommit_ms = _time_commit(vmm, size_bytes, chunk)
            rows.append(
                {
                    "backend": vmm.name,
                    "case": label,
                    "size_gib": size_gib,
                    "commit_ms": commit_ms,
                    "decommit_ms": decommit_ms,
                    "commit_gib_per_s": size_gib / (commit_ms / 1e3),
                }
            )
    if pool_gib * GIB < free_bytes * 0.9:
        rows.append(_pool_finalize(vmm, int(pool_gib * GIB)))
    return rows


def run(args: argparse.Namespace) -> int:
    rows = run_backend(
        create_vmm("cpu", granularity_bytes=CHUNK_BYTES), args.host_sizes_gib, args.host_pool_gib
    )
    try:
        cuda_vmm = create_vmm("cuda")
    except VmmUnavailable as exc:
        print(f"CUDA VMM not measured: {exc}")
    else:
        rows += run_backend(cuda_vmm, args.cuda_sizes_gib, args.cuda_pool_gib)
    emit("vmm", rows, args.out)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host-sizes-gib", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--host-pool-gib", type=float, default=2.0)
    parser.add_argument("--cuda-sizes-gib", type=float, nargs="+", default=[1.0, 8.0, 64.0])
    parser.add_argument("--cuda-pool-gib", type=float, default=100.0)
