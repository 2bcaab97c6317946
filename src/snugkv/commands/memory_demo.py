"""`snugkv memory-demo`: how snugkv sizes its KV cache, step by step, in host RAM (no model, no GPU).

Reserves address space for a SmolLM2-135M-shaped KV pool, backs the dummy page, then backs
exactly what a RAM budget allows, writing into the highest slot to show it is really there.
(`make demo` is something else: it answers a question with the default model.)
"""

from __future__ import annotations

import argparse
import time


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "memory-demo",
        help="walk through reserving, backing and sizing a KV cache in RAM (no model)",
        description=__doc__,
    )
    parser.add_argument(
        "--budget-gib", type=float, default=0.5, help="RAM the KV cache may take (default 0.5)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from snugkv.memory.arena import KvArena
    from snugkv.memory.kv_pool import KVPoolSpec, MHAKVPool
    from snugkv.memory.vmm import GIB, MIB
    from snugkv.memory.vmm_factory import create_vmm

    vmm = create_vmm("cpu", granularity_bytes=2 * MIB)
    arena = KvArena(vmm, 64 * GIB, label="memory-demo")
    layers, kv_heads, head_dim = 30, 3, 64  # SmolLM2-135M
    upper_tokens = 1_000_000
    pool = MHAKVPool(
        KVPoolSpec.of(dtype="float32", page_size=16, layout="hnd", device="cpu", mode="post-capture"),
        reserved_tokens=upper_tokens,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        arena=arena,
    )
    print(
        f"1. reserved   {arena.reserved_bytes / GIB:7.2f} GiB of address space, {len(arena.buffers)} buffers placed "
        f"({pool.reserved_bytes / GIB:.2f} GiB for {upper_tokens:,} tokens), committed {pool.committed_bytes / MIB:.0f} MiB"
    )
    pool.ensure_prefix()
    print(f"2. dummy page backed: committed {pool.committed_bytes / MIB:.0f} MiB (one granule per buffer)")
    budget = int(args.budget_gib * GIB)
    tokens = pool.max_tokens_within(budget)
    start = time.perf_counter()
    tokens = pool.finalize_backing(tokens)
    took_ms = (time.perf_counter() - start) * 1e3
    print(
        f"3. sized to a {args.budget_gib} GiB budget: max_total_num_tokens={tokens:,} "
        f"({pool.bytes_per_token:.0f} bytes/token), committed {pool.committed_bytes / GIB:.3f} GiB in {took_ms:.1f} ms"
    )
    high = torch.tensor([tokens + pool.page_size - 1])
    values = torch.full((1, kv_heads, head_dim), 1.25)
    pool.set_kv(layers - 1, high, values, values)
    key = pool.get_kv_buffer(layers - 1)[0]
    stored = key[high // pool.page_size, :, high % pool.page_size]
    print(f"4. wrote slot {int(high):,} of layer {layers - 1}: reads back {stored.mean().item():.2f}")
    del key, stored
    pool.close()
    arena.close()
    print("5. released: pool views dropped, arena unmapped")
    return 0
