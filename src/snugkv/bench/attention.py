"""`snugkv bench attention`: Triton decode and extend attention against their floors, and launch sweeps.

Decode attention reads every cached K/V byte of the batch once, so its floor is KV bytes / copy
bandwidth (measured in the same run). For Llama-3-8B and Qwen3-0.6B attention shapes (bf16 and
fp8 KV, both layouts, page size 16) at batch 1-256 and context 1k-4k, every combination of
split count and launch shape (keys per step, warps, stages) is timed; the table gives the default
launch's time beside the best one found, both against the floor. Requests' pages are spread over
the pool in random order, as a pool that has served for a while holds them.

Extend (prefill) attention (`--kinds extend`) is bound by compute: its floor is the causal QK^T
and PV FLOPs (4 x head dim x query heads x sum over requests of L(L+1)/2 + L x prefix) at 790
TFLOP/s (dense bf16). For N requests of L new tokens (some on a cached prefix), every launch shape
(tokens per program, keys per step, warps, stages) is timed beside the default.
"""

from __future__ import annotations

import argparse
import itertools
import time
from typing import Any

import torch

from snugkv.bench.harness import (
    DENSE_BF16_FLOPS,
    copy_bandwidth_bytes_per_s,
    cuda_missing,
    emit,
    graph_seconds,
)

SHAPES = {"llama-3-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128)}  # q heads, KV heads, head dim
CASES = ((1, 1024), (64, 1024), (256, 1024), (64, 4096))
SPLITS = (2, 4, 8, 16)
BLOCK_N = (64, 128, 256)
WARPS = (4, 8)
STAGES = (3, 4)
PAGE = 16
# (requests, new tokens each, cached prefix each)
EXTEND_CASES = ((1, 8192, 0), (8, 1024, 0), (4, 512, 0), (4, 512, 2048))
EXTEND_BLOCK_M = (64, 128)
EXTEND_BLOCK_N = (32, 64, 128)
EXTEND_WARPS = (4, 8)
EXTEND_STAGES = (2, 3, 4)


def _case_tensors(
    batch: int, context: int, heads: tuple[int, int, int], kv_dtype: torch.dtype, layout: str
) -> dict[str, Any]:
    num_q, num_kv, dim = heads
    pages_per_request = -(-(context + 1) // PAGE)
    num_pages = batch * pages_per_request + 1
    shape = (num_pages, num_kv, PAGE, dim) if layout == "hnd" else (num_pages * PAGE, num_kv, dim)
    k_buffer = torch.randn(shape, device="cuda").to(kv_dtype)
    v_buffer = torch.randn(shape, device="cuda").to(kv_dtype)
    order = torch.randperm(num_pages - 1, device="cuda") + 1  # page 0 is the dummy page
    pages = order[: batch * pages_per_request].view(batch, pages_per_request)
    slots = (pages[:, :, None] * PAGE + torch.arange(PAGE, device="cuda")).view(batch, -1)[:, :context]
    table = torch.zeros(batch + 1, context + PAGE, dtype=torch.int32, device="cuda")
    table[1:, :context] = slots.int()
    return {
        "q": torch.randn(batch, num_q, dim, device="cuda", dtype=torch.bfloat16),
        "k": k_buffer,
        "v": v_buffer,
        "out": torch.empty(batch, num_q, dim, device="cuda", dtype=torch.bfloat16),
        "table": table,
        "rows": torch.arange(1, batch + 1, device="cuda"),
        "seq_lens": torch.full((batch,), context, device="cuda"),
        "kv_bytes": 2 * batch * context * num_kv * dim * k_buffer.element_size(),
    }


def _time(fn: Any, calls: int = 8) -> float:
    """Seconds per `fn()`: the median of 10 replays of a CUDA graph of `calls` calls (a bare launch
    of a small kernel would time the host's launch overhead, not the kernel)."""
    return graph_seconds(fn, calls=calls, iterations=10, warmup=2)


def run(args: argparse.Namespace) -> int:
    if cuda_missing("bench attention"):
        return 2
    started = time.perf_counter()
    kinds = args.kinds.split(",")
    rows = run_decode(args) if "decode" in kinds else []
    if "extend" in kinds:
        rows += run_extend(args)
    emit("attention", rows, args.out, extra={"seconds": time.perf_counter() - started})
    return 0


def _extend_tensors(requests: int, new: int, prefix: int, heads: tuple[int, int, int]) -> dict[str, Any]:
    num_q, num_kv, dim = heads
    total, context = requests * new, prefix + new
    num_slots = requests * context + PAGE  # slot 0.. of page 0 stay the dummy page
    k_buffer = torch.randn(num_slots, num_kv, dim, device="cuda", dtype=torch.bfloat16)
    v_buffer = torch.randn_like(k_buffer)
    slots = torch.randperm(num_slots - PAGE, device="cuda") + PAGE
    table = torch.zeros(requests + 1, context + PAGE, dtype=torch.int32, device="cuda")
    table[1:, :context] = slots[: requests * context].view(requests, context).int()
    pairs = new * (new + 1) // 2 + new * prefix
    return {
        "q": torch.randn(total, num_q, dim, device="cuda", dtype=torch.bfloat16),
        "k": torch.randn(total, num_kv, dim, device="cuda", dtype=torch.bfloat16),
        "v": torch.randn(total, num_kv, dim, device="cuda", dtype=torch.bfloat16),
        "out": torch.empty(total, num_q, dim, device="cuda", dtype=torch.bfloat16),
        "k_buffer": k_buffer,
        "v_buffer": v_buffer,
        "table": table,
        "rows": torch.arange(1, requests + 1, device="cuda"),
        "prefix_lens": torch.full((requests,), prefix, device="cuda", dtype=torch.int32),
        "extend_lens": torch.full((requests,), new, device="cuda", dtype=torch.int32),
        "start_loc": torch.arange(0, total, new, device="cuda", dtype=torch.int32),
        "flops": 4 * dim * num_q * requests * pairs,
    }


def run_extend(args: argparse.Namespace) -> list[dict[str, Any]]:
    from snugkv.attention.triton_extend import ExtendLaunch, default_extend_launch, extend_attention

    launches = [
        ExtendLaunch(m, n, w, s)
        for m, n, w, s in itertools.product(EXTEND_BLOCK_M, EXTEND_BLOCK_N, EXTEND_WARPS, EXTEND_STAGES)
    ]
    rows = []
    for shape_name, (requests, new, prefix) in itertools.product(args.shapes.split(","), EXTEND_CASES):
        heads = SHAPES[shape_name]
        t = _extend_tensors(requests, new, prefix, heads)
        floor_s = t["flops"] / DENSE_BF16_FLOPS

        def call(
            launch: ExtendLaunch, t: dict[str, Any] = t, new: int = new, scale: float = heads[2] ** -0.5
        ) -> None:
            extend_attention(
                t["q"], t["k"], t["v"], t["out"], t["k_buffer"], t["v_buffer"], t["table"], t["rows"],
                t["prefix_lens"], t["extend_lens"], t["start_loc"], sm_scale=scale, page_size=PAGE,
                max_extend_len=new, launch=launch,
            )  # fmt: skip

        default = default_extend_launch(heads[2], torch.device("cuda"), prefix_heavy=prefix > new)
        default_s = _time(lambda d=default: call(d), calls=4)
        best = (default_s, default)
        every: dict[str, float] = {}
        for launch in launches:
            try:
                seconds = _time(lambda la=launch: call(la), calls=4)
            except Exception as exc:  # a launch shape this GPU cannot run (shared memory)
                print(f"skip extend {shape_name} {requests}x{new}+{prefix} {launch}: {type(exc).__name__}")
                continue
            every[f"{launch.block_m}/{launch.block_n}/{launch.num_warps}/{launch.num_stages}"] = seconds * 1e3
            if seconds < best[0]:
                best = (seconds, launch)
        rows.append(
            {
                "kind": "extend",
                "shape": shape_name,
                "requests": requests,
                "new_tokens": new,
                "prefix": prefix,
                "floor_ms": floor_s * 1e3,
                "default_ms": default_s * 1e3,
                "default_over_floor": default_s / floor_s,
                "default_tflops": t["flops"] / default_s / 1e12,
                "best_ms": best[0] * 1e3,
                "best_over_floor": best[0] / floor_s,
                "best_block_m": best[1].block_m,
                "best_block_n": best[1].block_n,
                "best_warps": best[1].num_warps,
                "best_stages": best[1].num_stages,
                "default": f"{default.block_m}/{default.block_n}/{default.num_warps}/{default.num_stages}",
                "every_launch_ms": every,
            }
        )
        print(rows[-1], flush=True)
        del t
    return rows


def run_decode(args: argparse.Namespace) -> list[dict[str, Any]]:
    from snugkv.attention.triton_decode import (
        DecodeLaunch,
        decode_attention,
        decode_splits,
        default_decode_launch,
    )

    bandwidth = copy_bandwidth_bytes_per_s()
    launches = [DecodeLaunch(n, w, s) for n, w, s in itertools.product(BLOCK_N, WARPS, STAGES)]
    rows = []
    for shape_name in args.shapes.split(","):
        heads = SHAPES[shape_name]
        for kv_name, layout, (batch, context) in itertools.product(
            args.kv_dtypes.split(","), args.layouts.split(","), CASES
        ):
            kv_dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[kv_name]
            t = _case_tensors(batch, context, heads, kv_dtype, layout)
            floor_s = t["kv_bytes"] / bandwidth

            def call(
                splits: int,
                launch: DecodeLaunch,
                t: dict[str, Any] = t,
                layout: str = layout,
                scale: float = heads[2] ** -0.5,
            ) -> None:
                decode_attention(
                    t["q"], t["k"], t["v"], t["out"], t["table"], t["rows"], t["seq_lens"],
                    sm_scale=scale, page_size=PAGE, layout=layout, num_kv_splits=splits,
                    launch=launch,
                )  # fmt: skip

            default = default_decode_launch(heads[2], torch.device("cuda"))
            default_splits = decode_splits(batch, heads[1])
            default_s = _time(lambda d=default, n=default_splits: call(n, d))
            best = (default_s, default_splits, default)
            for splits, launch in itertools.product(SPLITS, launches):
                try:
                    seconds = _time(lambda s=splits, la=launch: call(s, la))
                except Exception as exc:  # a launch shape this GPU cannot run (shared memory)
                    print(
                        f"skip {shape_name} {kv_name} {layout} b{batch} c{context} {splits} {launch}: {exc}"
                    )
                    continue
                if seconds < best[0]:
                    best = (seconds, splits, launch)
            rows.append(
                {
                    "kind": "decode",
                    "copy_bandwidth_gb_per_s": bandwidth / 1e9,
                    "default_splits": default_splits,
                    "shape": shape_name,
                    "kv": kv_name,
                    "layout": layout,
                    "batch": batch,
                    "context": context,
                    "floor_ms": floor_s * 1e3,
                    "default_ms": default_s * 1e3,
                    "default_over_floor": default_s / floor_s,
                    "best_ms": best[0] * 1e3,
                    "best_over_floor": best[0] / floor_s,
                    "best_splits": best[1],
                    "best_block_n": best[2].block_n,
                    "best_warps": best[2].num_warps,
                    "best_stages": best[2].num_stages,
                }
            )
            print(rows[-1], flush=True)
            del t
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", default="llama-3-8b", help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--kv-dtypes", default="bf16,fp8", help="comma-separated: bf16, fp8")
    parser.add_argument("--layouts", default="nhd,hnd", help="comma-separated: nhd, hnd")
    parser.add_argument("--kinds", default="decode,extend", help="comma-separated: decode, extend")
