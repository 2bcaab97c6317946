"""`python -m snugkv.bench.moe_tune`: the MoE kernels' block sizes for one model's expert geometry.

One layer of the model's shape (`--model`, default qwen3-30b-a3b), random bf16 experts and router
logits, at each token count (`--tokens`, default 1 64 256 8192). Each candidate config runs the
whole routed part of the layer (`fused_moe_triton`: routing, sorting, both grouped GEMMs, the
combine) captured `--reps` times in one CUDA graph, timed over replays. Candidates are tried
in two passes per row block: gate/up tiles with the default down tiles, then down tiles with the
best gate/up; then, for decode-sized batches, sorting in one program or in parallel. Up to
moe_direct.direct_max_tokens() the direct path (no sort, moe_direct.py) is timed too, its tiles
in the same two passes, against the best sorted config: where it loses, the table says so
(`"direct": null`) and the engine sorts. The fastest per token count is written as a
SNUGKV_MOE_CONFIGS table (`moe_configs.json`: each entry covers token counts up to the geometric
mean with the next tuned count), next to a table of each token count's best and default times
(the default: what the engine runs without a table) against the layer's floors: the experts its
tokens touch read once (copy bandwidth measured in the same run), and 2 x 3 x H x I FLOPs per
routed row at the H200's dense bf16 rate.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from snugkv.bench.harness import (
    DENSE_BF16_FLOPS,
    copy_bandwidth_bytes_per_s,
    cuda_missing,
    emit,
    graph_seconds_per_call,
    save,
)
from snugkv.bench.model_configs import benchmark_model
from snugkv.kernels.moe_direct import DirectConfig, default_direct_config, direct_max_tokens
from snugkv.kernels.moe_experts import GemmConfig, MoEConfig, default_config, fused_moe_triton, geometry_key
from snugkv.kernels.moe_routing import Routing
from snugkv.layers.moe import SparseMoE
from snugkv.models.loader import build_model, read_model_config, resolve_model_source

DECODE_TILES = (
    GemmConfig(32, 128, 1, 4, 4),
    GemmConfig(64, 128, 1, 4, 4),
    GemmConfig(64, 64, 1, 4, 4),
    GemmConfig(128, 128, 1, 4, 3),
)
PREFILL_TILES = (
    GemmConfig(64, 64, 8, 4, 3),
    GemmConfig(64, 64, 8, 8, 3),
    GemmConfig(128, 64, 8, 8, 3),
    GemmConfig(64, 128, 8, 4, 3),
    GemmConfig(128, 64, 8, 4, 4),
)
# The direct path's tiles around its default for k=8 (moe_direct.default_direct_config, always
# timed): as many bytes a step in half the programs, and twice the bytes a step. Few, to keep the
# moe step of gpu_check.sh short: each is a compile.
DIRECT_GATE_UP_TILES = ((16, 512), (8, 1024))
DIRECT_DOWN_TILES = ((8, 256), (4, 512))


def moe_geometry(model: str) -> tuple[Routing, int, int]:
    """(routing, hidden size, intermediate size per expert) of the model's first MoE layer."""
    config = read_model_config(resolve_model_source(model, "dummy"))
    net = build_model(config, torch.bfloat16, torch.device("meta"))
    layer = next((m for m in net.modules() if isinstance(m, SparseMoE)), None)
    if layer is None:
        raise SystemExit(f"{model} has no MoE layers")
    return layer.routing, layer.shape.hidden_size, layer.shape.intermediate_size


def block_m_candidates(num_tokens: int, routing: Routing) -> tuple[int, ...]:
    rows_per_expert = num_tokens * routing.top_k / routing.num_experts
    if rows_per_expert <= 1:
        return (16,)
    if rows_per_expert <= 8:
        return (16, 32)
    if rows_per_expert <= 24:
        return (32, 64)
    return (64, 128)


Timer = Callable[[MoEConfig, Callable[[], Any]], float]


def graph_timer(reps: int, iters: int) -> Timer:
    """Seconds per call of a config's layer call in a CUDA graph; inf for a config that cannot run."""

    def timer(config: MoEConfig, call: Callable[[], Any]) -> float:
        try:
            return graph_seconds_per_call(call, reps, iters)
        except Exception as exc:  # a tile that does not fit (shared memory, registers) is skipped
            print(f"  {config} skipped: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)
            torch.cuda.synchronize()
            return math.inf

    return timer


def tune(
    num_tokens: int,
    routing: Routing,
    hidden: int,
    intermediate: int,
    *,
    timer: Timer,
    deadline: float,
    device: str = "cuda",
) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    experts = routing.num_experts

    def random(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen).mul_(scale).bfloat16()

    w13 = random(experts, 2 * intermediate, hidden, scale=hidden**-0.5)
    w2 = random(experts, hidden, intermediate, scale=intermediate**-0.5)
    x, logits = random(num_tokens, hidden), random(num_tokens, experts)
    timings: dict[str, float] = {}

    def measure(config: MoEConfig) -> float:
        key = json.dumps(asdict(config))
        if key not in timings:
            timings[key] = timer(config, lambda: fused_moe_triton(x, logits, w13, w2, routing, config))
        return timings[key]

    engine_default = default_config(num_tokens, routing.top_k, experts)
    default = replace(engine_default, direct=None)  # the sorted path's starting point
    best = default
    measure(default)
    tiles = DECODE_TILES if num_tokens * routing.top_k / experts <= 24 else PREFILL_TILES
    for block_m in block_m_candidates(num_tokens, routing):
        if time.perf_counter() > deadline:
            break
        start = replace(default, block_m=block_m)
        gate_up = min(tiles, key=lambda tile: measure(replace(start, gate_up=tile)))
        down = min(tiles, key=lambda tile: measure(replace(start, gate_up=gate_up, down=tile)))
        candidate = replace(start, gate_up=gate_up, down=down)
        if measure(candidate) < measure(best):
            best = candidate
    if num_tokens <= 256 and time.perf_counter() < deadline:
        flipped = replace(best, small_batch=not best.small_batch)
        if measure(flipped) < measure(best):
            best = flipped
    best_sorted, best_direct = best, None
    if num_tokens <= direct_max_tokens():
        best_direct = _tune_direct(best_sorted, routing.top_k, measure, deadline)
        if measure(best_direct) < measure(best):
            best = best_direct
    with torch.inference_mode():
        ids = torch.topk(logits.float(), routing.top_k, dim=-1).indices
    touched = int(torch.unique(ids).numel())
    return {
        "tokens": num_tokens,
        "best": best,
        "best_s": measure(best),
        "default_s": measure(engine_default),
        "sorted_s": measure(best_sorted),
        "direct_s": measure(best_direct) if best_direct is not None else None,
        "direct_timed": best_direct is not None,
        "experts_touched": touched,
        "candidates_timed": len(timings),
    }


def _tune_direct(
    sorted_config: MoEConfig, top_k: int, measure: Callable[[MoEConfig], float], deadline: float
) -> MoEConfig:
    """The direct path's fastest tiles: gate/up tiles with the default down tiles, then down tiles
    with the best gate/up, then twice the warps."""
    start = default_direct_config(top_k)

    def config(tiles: DirectConfig) -> MoEConfig:
        return replace(sorted_config, direct=tiles)

    best = start
    measure(config(best))
    for n, k in DIRECT_GATE_UP_TILES:
        if time.perf_counter() < deadline:
            best = min(
                best, replace(best, gate_up_block_n=n, gate_up_block_k=k), key=lambda d: measure(config(d))
            )
    for n, i in DIRECT_DOWN_TILES:
        if time.perf_counter() < deadline:
            best = min(best, replace(best, down_block_n=n, down_block_i=i), key=lambda d: measure(config(d)))
    if time.perf_counter() < deadline:
        best = min(best, replace(best, num_warps=2 * best.num_warps), key=lambda d: measure(config(d)))
    return config(best)


def table_entries(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """SNUGKV_MOE_CONFIGS entries: each tuned count covers counts up to the geometric mean with
    the next tuned count (the last one, every larger count)."""
    results = sorted(results, key=lambda r: r["tokens"])
    entries = []
    for index, result in enumerate(results):
        upper = (
            int(math.sqrt(result["tokens"] * results[index + 1]["tokens"]))
            if index + 1 < len(results)
            else 1 << 30
        )
        best: MoEConfig = result["best"]
        entry = {
            "max_tokens": upper,
            "block_m": best.block_m,
            "gate_up": list(asdict(best.gate_up).values()),
            "down": list(asdict(best.down).values()),
            "small_batch": best.small_batch,
            "tuned_at_tokens": result["tokens"],
        }
        if result.get("direct_timed"):  # null: sorting was faster here, so the engine sorts
            entry["direct"] = best.direct.as_list() if best.direct is not None else None
        entries.append(entry)
    return entries


def run(args: argparse.Namespace) -> int:
    if cuda_missing("bench moe_tune"):
        return 2
    started = time.perf_counter()
    routing, hidden, intermediate = moe_geometry(args.model)
    bandwidth = copy_bandwidth_bytes_per_s()
    expert_bytes = 3 * hidden * intermediate * 2
    results, rows = [], []
    for index, num_tokens in enumerate(args.tokens):
        remaining = len(args.tokens) - index
        deadline = time.perf_counter() + (args.budget_s - (time.perf_counter() - started)) / remaining
        result = tune(
            num_tokens,
            routing,
            hidden,
            intermediate,
            timer=graph_timer(args.reps, args.iters),
            deadline=deadline,
        )
        results.append(result)
        torch.cuda.empty_cache()  # the layer's weights of this count are gone with `tune`'s frame
        bytes_floor_s = result["experts_touched"] * expert_bytes / bandwidth
        flops_floor_s = 2 * num_tokens * routing.top_k * 3 * hidden * intermediate / DENSE_BF16_FLOPS
        floor_s = max(bytes_floor_s, flops_floor_s)
        best: MoEConfig = result["best"]
        rows.append(
            {
                "tokens": num_tokens,
                "experts_touched": result["experts_touched"],
                "best_us": result["best_s"] * 1e6,
                "default_us": result["default_s"] * 1e6,
                "bytes_floor_us": bytes_floor_s * 1e6,
                "flops_floor_us": flops_floor_s * 1e6,
                "best_over_floor": result["best_s"] / floor_s,
                "default_over_floor": result["default_s"] / floor_s,
                "sorted_best_us": result["sorted_s"] * 1e6,
                "direct_best_us": result["direct_s"] * 1e6 if result["direct_s"] is not None else None,
                "direct": str(best.direct.as_list()) if best.direct is not None else None,
                "block_m": best.block_m,
                "gate_up": str(list(asdict(best.gate_up).values())),
                "down": str(list(asdict(best.down).values())),
                "small_batch": best.small_batch,
                "candidates": result["candidates_timed"],
            }
        )
        print(rows[-1], flush=True)
    table = {
        geometry_key(routing.num_experts, routing.top_k, hidden, intermediate, torch.bfloat16): table_entries(
            results
        )
    }
    if args.out:
        save(Path(args.out) / "moe_configs.json", table)
    emit(
        "moe_tune",
        rows,
        args.out,
        extra={
            "model": args.model,
            "copy_bandwidth_gb_per_s": bandwidth / 1e9,
            "peak_flops": DENSE_BF16_FLOPS,
            "table": table,
            "seconds": time.perf_counter() - started,
        },
    )
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=benchmark_model, default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 8192])
    parser.add_argument("--reps", type=int, default=5, help="calls captured per graph")
    parser.add_argument("--iters", type=int, default=10, help="graph replays timed")
    parser.add_argument(
        "--budget-s", type=float, default=120.0, help="stop trying candidates after this long"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for moe_tune.json/.md and moe_configs.json")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
