"""`snugkv bench host`: the scheduler's host work per step at a full batch, with the model stubbed.

Runs on a CPU (or a GPU). The model's forward is replaced by a stub that returns a fixed logits
tensor, so what is timed is everything the host does around the GPU in the engine core's run loop
(`EngineCore.run`): choosing the batch, taking slots, building the forward batch, launching the
sampler, moving each request on (stop checks, outputs), freeing what finished. Two cases: `steady` keeps every request decoding (none finishes
while timed); `drain` runs requests of mixed output lengths to the end (finishes, releases,
prefix-cache inserts). Prints steps/s and microseconds per request per step, from the process's
CPU time (what the host spends, whatever else shares the machine; the wall time is printed too).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from snugkv.bench.harness import emit
from snugkv.bench.model_configs import write_tiny_llama_config
from snugkv.core.sampling import SamplingParams

STUB_VOCAB = 64  # the stub's logits: the sampler's own cost is not what this measures


def _engine(args: argparse.Namespace, directory: Path) -> Any:
    from snugkv.engine import Engine, EngineArgs

    context = args.prompt + args.steps * 4 + 64
    engine = Engine(
        EngineArgs.of(
            model=write_tiny_llama_config(directory, context, 512),
            load_format="dummy",
            device=args.device,
            dtype="float32",
            page_size=args.page_size,
            max_running_requests=args.batch,
            max_total_tokens=args.batch * (context + args.page_size),
            chunked_prefill_size=8192,
            host_kv_gib=0.5,
            disable_cuda_graph=True,  # the stub replaces the forward
        )
    )
    logits = torch.zeros(args.batch, STUB_VOCAB, device=engine.device)
    engine.runner.forward_batch = lambda batch: logits[: batch.logits_indices.numel()]  # type: ignore[method-assign,union-attr]
    return engine


def _core(engine: Any, overlap: bool) -> Any:
    from snugkv.driver.engine_core import EngineCore

    finished: dict[str, float] = {}
    return EngineCore.around(
        engine,
        on_output=lambda r, o: finished.__setitem__(o.rid, time.monotonic()) if o.finished else None,
        overlap=overlap,
    )


def _add(core: Any, count: int, prompt_len: int, max_new: list[int], seed: int) -> None:
    from snugkv.driver.commands import Add

    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 500) for _ in range(prompt_len)] for _ in range(count)]
    core.submit(
        Add(f"h{seed}-{index}", prompt, SamplingParams(max_new_tokens=max_new[index], ignore_eos=True))
        for index, prompt in enumerate(prompts)
    )


def steady(engine: Any, args: argparse.Namespace, overlap: bool) -> dict[str, Any]:
    from snugkv.driver.commands import AbortAll

    core = _core(engine, overlap)
    scheduler = core.scheduler
    _add(core, args.batch, args.prompt, [args.steps * 3] * args.batch, seed=0)
    core.run(until=lambda steps: not scheduler.waiting)  # prefill: every request admitted
    core.run(until=lambda steps: steps == args.warmup)
    best = best_wall = float("inf")
    window = args.steps // args.repeats
    for _ in range(args.repeats):
        start, start_wall = time.process_time(), time.perf_counter()
        core.run(until=lambda steps: steps == window)
        best = min(best, (time.process_time() - start) / window)
        best_wall = min(best_wall, (time.perf_counter() - start_wall) / window)
    batch = len(scheduler.running)
    core.apply(AbortAll())
    core.run()
    scheduler.check_slot_accounting()
    scheduler.cache.reset()
    return {
        "case": f"steady: {batch} requests decoding",
        "steps_per_s": 1 / best,
        "ms_per_step": best * 1e3,
        "us_per_request_step": best * 1e6 / batch,
        "wall_ms_per_step": best_wall * 1e3,
    }


def drain(engine: Any, args: argparse.Namespace, overlap: bool) -> dict[str, Any]:
    core = _core(engine, overlap)
    scheduler = core.scheduler
    rng = random.Random(1)
    max_new = [rng.randint(args.steps // 4, args.steps) for _ in range(args.batch)]
    _add(core, args.batch, args.prompt, max_new, seed=1)
    core.run(until=lambda steps: not scheduler.waiting)
    start, start_wall = time.process_time(), time.perf_counter()
    steps = core.run()
    elapsed, wall = time.process_time() - start, time.perf_counter() - start_wall
    scheduler.check_slot_accounting()
    scheduler.cache.reset()
    return {
        "case": f"drain: {args.batch} requests, out U[{args.steps // 4},{args.steps}]",
        "steps_per_s": steps / elapsed,
        "ms_per_step": elapsed * 1e3 / steps,
        "us_per_request_step": elapsed * 1e6 / (sum(max_new) - args.batch),
        "wall_ms_per_step": wall * 1e3 / steps,
    }


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as directory:
        engine = _engine(args, Path(directory))
        rows = []
        for mode in ("on", "off") if args.overlap == "both" else (args.overlap,):
            for case in (steady, drain):
                rows.append({"overlap": mode, **case(engine, args, overlap=mode == "on")})
        engine.close()
    emit("host", rows, args.out, extra={"batch": args.batch, "device": args.device})
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5, help="the best of this many timed runs")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--overlap",
        choices=("on", "off", "both"),
        default="both",
        help="overlapped scheduling on, off, or both side by side (default)",
    )
