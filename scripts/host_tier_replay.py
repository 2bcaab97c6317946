"""Replay the host-tier bench's chat workload through the prefix cache alone (CPU, no model): how
many prompt tokens each turn computes with and without a host tier, and the host time the cache's
operations take per request. The bench's shape: 512 sessions x 8 turns of 128 user + 16 output
tokens, turn by turn across sessions, 196,608 device tokens, a 64 GiB tier of the 8B shape
(524,288 tokens of 128 KiB). Each request: match, load back, make room, insert, as a request's
admission and release do.

    PYTHONPATH=src python scripts/host_tier_replay.py [--device-tokens N] [--host-tokens N (0: none)]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from snugkv.memory.allocator import make_allocator
from snugkv.memory.arena import KvArena
from snugkv.memory.host_tier import HostCopies, HostKvTier
from snugkv.memory.kv_pool import KVPoolSpec, MHAKVPool
from snugkv.memory.vmm_host import HostVmm
from snugkv.scheduler.radix_cache import RadixCache

PAGE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device-tokens", type=int, default=196_608)
    parser.add_argument("--host-tokens", type=int, default=524_288)
    parser.add_argument("--sessions", type=int, default=512)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--user-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=16)
    args = parser.parse_args()
    spec = KVPoolSpec.of(dtype="float32", page_size=PAGE, layout="nhd", device="cpu", mode="static")
    arena = KvArena(HostVmm(granularity_bytes=64 * 1024), 64 << 20, label="replay")
    pool = MHAKVPool(
        spec, reserved_tokens=args.device_tokens, num_layers=1, num_kv_heads=1, head_dim=1, arena=arena
    )  # one float a token: the copies cost nothing, the cache's bookkeeping is what is timed
    allocator = make_allocator(args.device_tokens, PAGE)
    tier = None
    if args.host_tokens:
        tier = HostKvTier(
            pool.page_views(), num_pages=args.host_tokens // PAGE, page_size=PAGE, copies=HostCopies(),
            pin_memory=False,
        )  # fmt: skip
    cache = RadixCache(allocator, host_tier=tier)
    rng = random.Random(0)
    histories: list[list[int]] = [[] for _ in range(args.sessions)]
    computed = prompted = 0
    host_s = 0.0
    for turn in range(args.turns):
        for session in range(args.sessions):
            new = [rng.randrange(5, 30_000) for _ in range(args.user_tokens + args.output_tokens)]
            tokens = histories[session] + new
            prompt = tokens[: -args.output_tokens]
            started = time.perf_counter()
            match = cache.match_prefix(prompt[:-1])
            if match.host_nodes:
                match = cache.load_back(match)
            cache.lock(match.node)
            need = -(-(len(tokens) - match.num_tokens) // PAGE) * PAGE
            if allocator.available_tokens < need:
                cache.evict_for_room(need - allocator.available_tokens)
            fresh = allocator.alloc(need)
            assert fresh is not None, "no room: the device holds fewer tokens than one request"
            slots = torch.cat([match.slots, fresh])[: len(tokens)]
            cache.unlock(match.node)
            existing = cache.insert(tokens, slots)
            usable = len(tokens) // PAGE * PAGE
            for part in (slots[match.num_tokens : existing], fresh[usable - match.num_tokens :]):
                if part.numel():
                    allocator.free(part)
            host_s += time.perf_counter() - started
            computed += len(prompt) - match.num_tokens
            prompted += len(prompt)
            histories[session] = tokens
        requests = (turn + 1) * args.sessions
        print(
            f"turn {turn}: computed {computed / prompted:.3f} of the prompt tokens so far; "
            f"cache operations {host_s / requests * 1e3:.2f} ms per request",
            flush=True,
        )


if __name__ == "__main__":
    main()
