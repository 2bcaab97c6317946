"""The static start-up modes (`--kv-sizing profiled` / `static-fraction`): profile the largest
eager step on a small pool, size the KV cache before capture from a fraction of the device, as
classic engines do, then allocate it from plain memory and capture the graphs.

For comparison and as the fallback without VMM; such a KV cache never changes size at run time.
This module orders the phases and logs the sizing line; the budgets live in snugkv.sizing.modes.
"""

from __future__ import annotations

import time

from snugkv.engine.blocks import EngineBlocks
from snugkv.engine.capture import capture_graphs, measure_activation_peak
from snugkv.engine.kv_sizing import KvSizing, StartupSizing
from snugkv.memory.kv_pool import PoolMode
from snugkv.memory.vmm import GIB
from snugkv.sizing.measure import agree_min, settle
from snugkv.sizing.modes import (
    SizingMode,
    profiled_kv_budget_bytes,
    static_fraction_budget,
    static_kv_tokens,
)
from snugkv.sizing.post_capture import SizingError


def start_static(blocks: EngineBlocks, timings: dict[str, float]) -> tuple[KvSizing, StartupSizing]:
    """Profiled / static-fraction: size KV before capture, as classic engines do. The KV sizing
    object and what it sized; adds the phases' seconds to `timings`."""
    args, mode = blocks.args, blocks.mode
    page = blocks.page_size
    pages = max(2, blocks.chunked_prefill_size // page + 1)
    probe = blocks.pool(PoolMode.STATIC, pages * page)
    peaking = time.perf_counter()
    peak = measure_activation_peak(blocks, blocks.build_runner(probe))
    timings["activation_peak_s"] = time.perf_counter() - peaking
    bytes_per_token = probe.bytes_per_token
    probe.close()
    settle(blocks.device)
    measured = time.perf_counter()
    free, total = blocks.memory.mem_get_info()
    if mode is SizingMode.PROFILED:
        budget = profiled_kv_budget_bytes(
            total_bytes=total,
            used_bytes=total - free,
            activation_peak_bytes=peak,
            gpu_memory_utilization=args.memory.gpu_memory_utilization,
        )
    else:
        budget = static_fraction_budget(
            total_bytes=total,
            used_bytes=total - free,
            chunked_prefill_tokens=blocks.chunked_prefill_size,
            max_graph_batch=max(blocks.graph_batch_sizes(), default=0),
            mem_fraction_static=args.memory.mem_fraction_static,
        ).kv_budget_bytes
    if args.memory.max_device_memory_gib is not None:  # the cap: what the engine holds now plus KV and peak
        cap_bytes = int(args.memory.max_device_memory_gib * GIB)
        used = blocks.engine_device_bytes(pool=None)
        budget = min(budget, cap_bytes - used - peak)
    tokens = static_kv_tokens(budget, bytes_per_token, page, args.memory.max_total_tokens)
    tokens = agree_min(tokens, blocks.group)  # tp: every rank the same count
    if tokens <= 0:
        raise SizingError(
            f"--kv-sizing {mode} leaves no memory for the KV cache ({budget / GIB:.2f} GiB budget); "
            "raise --gpu-memory-utilization / --mem-fraction-static"
            + (" / --max-device-memory" if args.memory.max_device_memory_gib is not None else "")
            + " or use post-capture sizing"
        )
    pool = blocks.pool(PoolMode.STATIC, tokens)
    runner = blocks.build_runner(pool)
    sizing_ms = (time.perf_counter() - measured) * 1e3
    timings.update(capture_graphs(blocks, runner))
    kv = blocks.kv_sizing(runner, headroom_bytes=0)  # the static modes keep no headroom
    kv.check_usable()
    max_running = kv.recap(pool.committed_tokens)
    blocks.log(
        "KV sizing (%s): max_total_num_tokens=%d, committed=%.2f GiB, budget=%.2f GiB, took=%.1f ms",
        mode,
        pool.committed_tokens,
        pool.committed_bytes / GIB,
        budget / GIB,
        sizing_ms,
    )
    return kv, StartupSizing(
        pool.committed_tokens,
        max_running,
        retries=0,
        per_rank_free_bytes=(),
        sizing_ms=sizing_ms,
    )
