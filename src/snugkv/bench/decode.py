"""`snugkv bench decode`: decode step time with CUDA graphs against the bandwidth floor.

A Llama-3-8B-shaped model (bf16, random weights) decodes batches of 1..256 requests at context
1k and 4k. Each step reads every weight once and every cached K/V once, so the floor is
(weight bytes + KV bytes) / copy bandwidth, with the copy bandwidth measured in the same run.
The same shapes then run through `transformers` (static cache, eager) for the ratio. KV is
filled with random values first: nothing is timed on zeros.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch

from snugkv.bench.model_configs import benchmark_model
from snugkv.bench.report import cuda_missing, emit
from snugkv.memory.vmm import GIB
from snugkv.sampling_params import SamplingParams

CASES = ((1, 1024), (16, 1024), (64, 1024), (256, 1024), (1, 4096), (16, 4096), (64, 4096), (256, 4096))


def copy_bandwidth_bytes_per_s(size_bytes: int = 4 * GIB) -> float:
    """Device-to-device copy: bytes read plus bytes written, per second (median of 20)."""
    source = torch.empty(size_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    target = torch.empty_like(source)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del source, target
    return 2 * size_bytes / sorted(times[5:])[len(times[5:]) // 2]


def time_cuda(fn: Any, iterations: int = 30, warmup: int = 5) -> float:
    """Median seconds of `fn()` measured with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def snugkv_cases(model: str, cases: tuple[tuple[int, int], ...]) -> tuple[list[dict[str, Any]], int, int]:
    from snugkv.engine import Engine, EngineArgs
    from snugkv.runner.forward_batch import BatchRow

    engine = Engine(
        EngineArgs(
            model=model,
            load_format="dummy",
            max_running_requests=256,
            cuda_graph_max_bs=256,
            chunked_prefill_size=8192,
        )
    )
    runner = engine.runner
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.loaded.model.parameters())
    kv_bytes_per_token = int(engine.pool.bytes_per_token)
    for layer in range(engine.config.num_layers):  # random KV everywhere a case will read
        for buffer in engine.pool.get_kv_buffer(layer):
            rows = (
                engine.pool.capacity_tokens // engine.pool.page_size + 1
                if buffer.dim() == 4
                else engine.pool.capacity_tokens
            )
            buffer[:rows].normal_()
    del buffer  # a live view would keep the arena from closing
    results = []
    for batch, context in cases:
        if batch * (context + engine.pool.page_size) > runner.allocator.available_tokens:
            results.append({"batch": batch, "context": context, "note": "does not fit the KV pool"})
            continue
        rows, requests = [], []
        for _ in range(batch):
            row = runner.req_to_token_pool.alloc()
            runner.allocate_slots([BatchRow(row, 0, [1] * context)])
            rows.append(BatchRow(row, context, [1]))
            requests.append(row)
        slots = runner.allocate_slots(rows)
        forward_batch = runner.build_batch(rows, slots)
        with torch.inference_mode():
            graph_s = time_cuda(lambda fb=forward_batch: runner.forward_batch(fb))
            step_s = time_cuda(
                lambda r=rows, s=slots, b=batch: runner.sample(runner.forward(r, s), [_GREEDY] * b)
            )
        results.append(
            {
                "batch": batch,
                "context": context,
                "graph_ms": graph_s * 1e3,
                "step_ms": step_s * 1e3,
                "weight_bytes": weight_bytes,
                "kv_bytes": batch * (context + 1) * kv_bytes_per_token,
            }
        )
        for row in requests:
            runner.free_request_slots(row, context + 1)
            runner.req_to_token_pool.free(row)
    engine.close()
    return results, weight_bytes, kv_bytes_per_token


_GREEDY = SamplingParams(temperature=0.0)


def transformers_cases(model: str, cases: tuple[tuple[int, int], ...]) -> dict[tuple[int, int], float]:
    """transformers' decode step times, measured in a child process (a CUDA error there cannot
    take this process's results with it)."""
    import json
    import subprocess
    import sys

    for cache in ("static", "dynamic"):
        command = [sys.executable, "-m", "snugkv.bench.decode_transformers", model, json.dumps(cases), cache]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if lines:
            break
        print(f"transformers decode with the {cache} cache failed:", done.stderr[-1200:])
    else:
        return {}
    result = json.loads(lines[-1])
    print(f"transformers decode path: {result['path']}")
    return {(batch, context): ms for batch, context, ms in result["timings"]}


def run(args: argparse.Namespace) -> int:
    if cuda_missing("bench decode"):
        return 2
    bandwidth = copy_bandwidth_bytes_per_s()
    cases = tuple(c for c in CASES if c[0] <= args.max_batch)
    started = time.perf_counter()
    results, _, _ = snugkv_cases(args.model, cases)
    gc.collect()
    torch.cuda.empty_cache()
    hf_ms = (
        transformers_cases(args.model, tuple((r["batch"], r["context"]) for r in results if "graph_ms" in r))
        if args.transformers
        else {}
    )
    rows = []
    for result in results:
        if "graph_ms" not in result:
            rows.append({"batch": result["batch"], "context": result["context"], "note": result["note"]})
            continue
        floor_ms = (result["weight_bytes"] + result["kv_bytes"]) / bandwidth * 1e3
        hf = hf_ms.get((result["batch"], result["context"]), float("nan"))
        rows.append(
            {
                "batch": result["batch"],
                "context": result["context"],
                "graph_step_ms": result["graph_ms"],
                "engine_step_ms": result["step_ms"],
                "floor_ms": floor_ms,
                "graph_over_floor": result["graph_ms"] / floor_ms,
                "step_over_floor": result["step_ms"] / floor_ms,
                "transformers_ms": hf,
                "transformers_over_snugkv": hf / result["step_ms"],
                "tokens_per_s": result["batch"] / result["step_ms"] * 1e3,
            }
        )
    emit(
        "decode",
        rows,
        args.out,
        extra={
            "copy_bandwidth_gb_per_s": bandwidth / 1e9,
            "seconds": time.perf_counter() - started,
            "model": args.model,
        },
    )
    print(f"copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=benchmark_model, default="llama-3-8b")
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--no-transformers", dest="transformers", action="store_false")
