"""`snugkv bench capacity`: KV capacity and waste of each sizing mode, side by side.

For each model and mode, a fresh process starts the engine (random weights of the real shape,
decode graphs up to batch 256, prefill chunk 8192) and reports: KV tokens and GiB, the sizing
time, the memory ledger, greedy tokens for fixed prompts (every mode must produce the same), and
a stress at the worst shapes: every slot of the pool in use by the largest graph batch, a decode
step, then the largest prefill chunk. Free memory right after the stress (the caching allocator
keeps its peak) is the waste; an OOM is recorded, not hidden.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from snugkv.bench.harness import cuda_missing, emit
from snugkv.bench.model_configs import benchmark_model
from snugkv.core.sampling import SamplingParams
from snugkv.memory.vmm import GIB, MIB

MODES = ("post-capture", "profiled", "static-fraction")
PROMPTS_SEED = 1234


def _free_bytes(engine: Any) -> int:
    """Free device memory now, without emptying torch's cache (so it reflects the peak)."""
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return int(engine.memory.mem_get_info()[0])


def _greedy_tokens(engine: Any, count: int = 4, new_tokens: int = 16) -> list[list[int]]:
    from snugkv.core.sampling import SamplingParams
    from snugkv.driver.commands import Add
    from snugkv.driver.engine_core import EngineCore

    outputs: dict[str, list[int]] = {}
    core = EngineCore.around(engine, on_output=lambda r, o: outputs.setdefault(o.rid, []).extend(o.token_ids))
    generator = torch.Generator().manual_seed(PROMPTS_SEED)
    vocab = engine.config.vocab_size
    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    prompts = [torch.randint(10, vocab, (64 + 37 * i,), generator=generator).tolist() for i in range(count)]
    core.submit(Add(f"p{index}", prompt, greedy) for index, prompt in enumerate(prompts))
    core.run()
    core.scheduler.cache.reset()
    return [outputs[f"p{index}"] for index in range(count)]


def _stress(engine: Any) -> dict[str, Any]:
    """Largest graph batch over every slot of the pool, a decode step, then the largest prefill chunk."""
    from snugkv.core.forward import BatchRow

    runner = engine.runner
    allocator, table = runner.allocator, runner.req_to_token_pool
    page = allocator.page_size
    chunk = min(engine.args.scheduler.chunked_prefill_size, engine.context_length - 1)
    batch = engine.report.max_running_requests - 1
    spare = allocator.available_tokens - chunk - 2 * page - batch * page
    context = max(page, min(spare // batch // page * page, engine.context_length - 2))
    readings = {"before": _free_bytes(engine)}
    rows = []
    for _ in range(batch):
        row = table.alloc()
        if runner.allocate_slots([BatchRow(row, 0, [1] * context)]) is None:
            raise RuntimeError("stress fill ran out of slots")
        rows.append(BatchRow(row, context, [1]))
    decode_slots = runner.allocate_slots(rows)
    runner.sample(runner.forward(rows, decode_slots), [_SAMPLING] * len(rows))
    readings["after_decode"] = _free_bytes(engine)
    prefill_row = table.alloc()
    prefill = [BatchRow(prefill_row, 0, [1] * chunk)]
    runner.sample(runner.forward(prefill, runner.allocate_slots(prefill)), [_SAMPLING])
    readings["after_prefill"] = _free_bytes(engine)
    used = allocator.capacity_tokens - allocator.available_tokens
    return {
        "stress_batch": batch,
        "stress_context": context,
        "stress_chunk": chunk,
        "pool_in_use": used / allocator.capacity_tokens,
        "free_at_peak_bytes": min(readings.values()),
        "max_reserved_bytes": torch.cuda.max_memory_reserved(),
    }


_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)


def worker(args: argparse.Namespace) -> int:
    from snugkv.engine import Engine, EngineArgs

    result: dict[str, Any] = {"model": Path(args.model).name, "mode": args.mode}
    started = time.perf_counter()
    try:
        engine = Engine(
            EngineArgs.of(
                model=args.model,
                load_format="dummy",
                kv_sizing=args.mode,
                chunked_prefill_size=args.chunk,
                cuda_graph_max_bs=args.max_batch,
                max_running_requests=args.max_batch,
                mem_fraction_static=args.mem_fraction_static,
            )
        )
    except Exception as exc:  # an OOM at start-up is a result of this mode, not a crash of the benchmark
        result.update(error=f"start-up failed: {type(exc).__name__}: {exc}"[:400])
        print(json.dumps(result), flush=True)
        return 0
    report = engine.report
    result.update(
        startup_s=time.perf_counter() - started,
        max_total_num_tokens=report.max_total_num_tokens,
        kv_gib=report.ledger.kv_committed_bytes / GIB,
        sizing_ms=report.sizing_ms,
        free_after_sizing_gib=report.ledger.free_bytes / GIB,
        ledger=report.ledger.to_dict(),
        unaccounted_mib=report.ledger.unaccounted_bytes / MIB,
        timings=report.timings,
    )
    result["greedy_tokens"] = _greedy_tokens(engine)
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        result.update(_stress(engine))
        result["oom"] = False
    except torch.OutOfMemoryError as exc:
        result.update(oom=True, error=str(exc)[:300])
    print(json.dumps(result), flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    if cuda_missing("bench capacity"):
        return 2
    if args.worker:
        return worker(args)
    results = []
    for model in args.models:
        for mode in args.modes:
            command = [
                sys.executable,
                "-m",
                "snugkv",
                "--log-level",
                "WARNING",
                "bench",
                "capacity",
                "--worker",
                "--model",
                model,
                "--mode",
                mode,
                "--chunk",
                str(args.chunk),
                "--max-batch",
                str(args.max_batch),
            ]
            if args.mem_fraction_static is not None:
                command += ["--mem-fraction-static", str(args.mem_fraction_static)]
            try:
                done = subprocess.run(
                    command, capture_output=True, text=True, timeout=args.timeout_s, check=False
                )
            except subprocess.TimeoutExpired:
                error = f"the worker did not finish within --timeout-s {args.timeout_s}"
                results.append({"model": Path(model).name, "mode": mode, "error": error})
                continue
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if not lines:
                error = done.stderr[-600:] or f"the worker exited with {done.returncode} and no result"
                results.append({"model": Path(model).name, "mode": mode, "error": error})
                continue
            results.append(json.loads(lines[-1]))
            print(f"{Path(model).name} {mode}: {lines[-1][:200]}", flush=True)
    rows = []
    for result in results:
        reference = next(
            (r for r in results if r["model"] == result["model"] and r["mode"] == "post-capture"), {}
        )
        rows.append(
            {
                "model": result["model"],
                "mode": result["mode"],
                "kv_tokens": result.get("max_total_num_tokens", 0),
                "kv_gib": round(result.get("kv_gib", 0.0), 2),
                "free_after_sizing_gib": round(result.get("free_after_sizing_gib", 0.0), 2),
                "free_at_peak_gib": round(result.get("free_at_peak_bytes", 0) / GIB, 2),
                "pool_in_use": round(result.get("pool_in_use", 0.0), 3),
                "oom": result.get("oom", "error" in result),
                "sizing_ms": round(result.get("sizing_ms", 0.0), 1),
                "unaccounted_mib": round(result.get("unaccounted_mib", 0.0), 1),
                "tokens_equal_post_capture": result.get("greedy_tokens") == reference.get("greedy_tokens")
                if "greedy_tokens" in result
                else None,
            }
        )
    emit("capacity", rows, args.out, extra={"results": results})
    if args.out:
        _plot(results, Path(args.out))
    failed = [f"{r['model']} {r['mode']}" for r in results if "error" in r or r.get("oom")]
    if failed:
        print(f"error: {len(failed)} of {len(results)} rows failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _plot(results: list[dict[str, Any]], out_dir: Path) -> None:
    from snugkv.bench.plots import plot_ledgers
    from snugkv.sizing.ledger import MemoryLedger

    for model in dict.fromkeys(r["model"] for r in results):
        ledgers = {}
        for result in results:
            if result["model"] == model and "ledger" in result:
                fields = {k: v for k, v in result["ledger"].items() if k in MemoryLedger.__dataclass_fields__}
                ledgers[result["mode"]] = MemoryLedger(**fields)
        if ledgers:
            plot_ledgers(
                ledgers,
                str(out_dir / f"capacity-{model}.png"),
                title=f"memory ledger per sizing mode: {model}",
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        nargs="+",
        type=benchmark_model,
        default=[benchmark_model("llama-3-8b"), benchmark_model("qwen3-0.6b")],
        help="config paths or shipped config names (default: llama-3-8b qwen3-0.6b)",
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--timeout-s", type=int, default=300)
    parser.add_argument("--chunk", type=int, default=8192, help="largest prefill chunk (default: 8192)")
    parser.add_argument(
        "--max-batch", type=int, default=256, help="largest decode graph batch (default: 256)"
    )
    parser.add_argument("--mem-fraction-static", type=float, default=None, help="static-fraction mode only")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=benchmark_model, help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
