"""The post-capture start-up (steps 2 to 7 of `Engine.__init__`): reserve the KV pool's address
space from all free memory, capture the graphs against it, measure the largest eager step's
activation peak, then have the KV sizing object measure free memory and back exactly what is
left (`KvSizing.size_after_capture`).

This module orders those phases and logs the sizing line; the sizing arithmetic lives in
snugkv.engine.kv_sizing and snugkv.sizing, the capture in snugkv.engine.capture.
"""

from __future__ import annotations

import time

from snugkv.engine.blocks import EngineBlocks, per_rank_text
from snugkv.engine.capture import capture_graphs, measure_activation_peak
from snugkv.engine.kv_sizing import KvSizing, StartupSizing
from snugkv.engine.memory_backend import host_headroom_bytes
from snugkv.memory.kv_pool import PoolMode
from snugkv.memory.vmm import GIB, MIB
from snugkv.sizing.measure import measure_free


def start_post_capture(blocks: EngineBlocks, timings: dict[str, float]) -> tuple[KvSizing, StartupSizing]:
    """The KV sizing object and what it sized; adds the phases' seconds to `timings`."""
    page = blocks.page_size
    reserving = time.perf_counter()
    # 2. Reserve: an upper bound from all free memory, no graph or activation reserve.
    free = measure_free(blocks.memory, blocks.group)
    probe = blocks.pool(PoolMode.POST_CAPTURE, page * 1024)
    bytes_per_token = probe.bytes_per_token
    probe.close()
    # The reserve bounds every later grow: an engine that starts beside others (--kv-elastic)
    # reserves more than is free now (--kv-reserve-gib), to grow into what they give back.
    args = blocks.args
    reserve_bytes = int(args.memory.kv_reserve_gib * GIB) if args.memory.kv_reserve_gib else free.min_bytes
    reserved_tokens = max(int(reserve_bytes // bytes_per_token), page)
    if args.memory.max_total_tokens:
        reserved_tokens = min(reserved_tokens, args.memory.max_total_tokens + page)
    pool = blocks.pool(PoolMode.POST_CAPTURE, reserved_tokens)
    # 3. Back the dummy page, 4. capture the decode graphs against the fixed addresses.
    runner = blocks.build_runner(pool)
    timings["reserve_s"] = time.perf_counter() - reserving
    timings.update(capture_graphs(blocks, runner))
    # 5. Measure the activation peak of the largest eager step; it and the margin stay free.
    peaking = time.perf_counter()
    peak = measure_activation_peak(blocks, runner)
    timings["activation_peak_s"] = time.perf_counter() - peaking
    headroom = (
        peak + args.memory.headroom_margin_mib * MIB
        if blocks.device.type == "cuda"
        else host_headroom_bytes()
    )
    # 6. Measure free memory, size, commit (with retry), 7. resize the allocators, re-cap.
    kv = blocks.kv_sizing(runner, headroom)
    sized = kv.size_after_capture()
    free_after = blocks.memory.mem_get_info()[0]
    blocks.log(
        "Post-capture KV sizing: max_total_num_tokens=%d, committed=%.2f GiB, headroom=%.2f GiB, "
        "guest room=%.2f GiB, free after=%.2f GiB, took=%.1f ms%s",
        sized.max_total_num_tokens,
        pool.committed_bytes / GIB,
        headroom / GIB,
        kv.guest_room_bytes / GIB,
        free_after / GIB,
        sized.sizing_ms,
        per_rank_text(sized.per_rank_free_bytes),
    )
    return kv, sized
