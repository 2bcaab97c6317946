"""`snugkv bench http`: the same offline load in process and through the real HTTP server.

What the HTTP path costs the engine. The offline workload of `bench serving` (N requests, input and
output lengths uniform in [100, 1024], `ignore_eos`, all at once) runs: straight to a scheduler
(in process, no server), through `EngineThread.generate` from an asyncio loop in this process (the
scheduler thread and the output hand-off, no HTTP), then through a fresh server process driven by
an `httpx` async client, streamed and not streamed (one server, a warm-up and one untimed pass of
the whole workload first, as in process). Each row has
output tok/s and the device-idle fraction (1 - device busy / wall: the share of the run the device
waited for the host); the HTTP rows also the CPU seconds of the server's event-loop thread
(`loop_cpu_s`) and of its other threads, the scheduler's (`other_threads_cpu_s`), and the client's
(`client_cpu_s`): figures a busy machine does not change much, unlike the wall time. `--tokenizer default` detokenizes (and so
streams text) with the embedded SmolLM2's tokenizer, in process too; the shipped shapes have none.

`--quantization fp8` (CUDA) runs only the servers: the offline workload streamed through a fresh
`snugkv serve` of the bf16 model, then of the FP8 one (`--quantization fp8` on the same random
weights), each after the 16-request warm-up (no untimed pass of the whole workload: the graphs'
warm-up already met every decode batch and prefill bucket, and the FP8 GEMMs were chosen there), and
the FP8 server's output tok/s over the bf16 one's.

With `--stub-step-ms` (any machine) the model forward is a stub device (`stub_device`): each step
takes a fixed time on a virtual device clock and reading its tokens releases the GIL as a CUDA
event wait does, so the scheduler thread, the overlap and the server's event loop contend as on a
GPU. Without it (CUDA) the model is the real one with random weights and the server is `snugkv serve`.

With `--url` the same offline load, a request rate and a multi-turn chat run against a server that
is already running, any OpenAI-compatible one (`openai_load`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from snugkv.bench.harness import cuda_missing, emit
from snugkv.bench.idle import gc_figures, step_figures
from snugkv.bench.model_configs import benchmark_model
from snugkv.bench.openai_load import add_url_arguments, run_against_url
from snugkv.bench.serving import bench_llm, run_scheduler, workload
from snugkv.bench.serving_http import run_on_server, serve_command
from snugkv.bench.stub_device import add_stub_arguments, stub_engine, stub_tokenizer
from snugkv.core.gc_pauses import GC_PAUSES
from snugkv.core.outputs import GenerateInput
from snugkv.core.sampling import SamplingParams


async def _through_async_engine(async_engine: Any, requests: list[tuple[list[int], int]]) -> int:
    async def one(index: int, prompt: list[int], max_tokens: int) -> int:
        sampling = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        tokens = 0
        async for output in async_engine.generate(GenerateInput(f"a{index}", prompt, sampling)):
            tokens += len(output.token_ids)
        return tokens

    counts = await asyncio.gather(*(one(i, prompt, out) for i, (prompt, out) in enumerate(requests)))
    return sum(counts)


def run_async_engine(engine: Any, tokenizer: Any, requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    """The workload through the server's engine interface in this process (no HTTP)."""
    from snugkv.driver.engine_core import EngineCore
    from snugkv.driver.engine_thread import EngineThread

    async_engine = EngineThread(EngineCore.around(engine, tokenizer=tokenizer), model_name="bench")
    try:
        times = async_engine.scheduler.times
        busy_before = times.device_busy_s
        gc_before = GC_PAUSES.as_dict()
        start = time.monotonic()
        tokens = asyncio.run(_through_async_engine(async_engine, requests))
        elapsed = time.monotonic() - start
        busy = times.device_busy_s - busy_before
        steps = step_figures(list(times.records), start, start + elapsed)
        steps.update(gc_figures(gc_before, GC_PAUSES.as_dict()))
    finally:
        async_engine.stop(close_engine=False)  # the next case runs on the same engine
    async_engine.scheduler.cache.reset()
    return {
        "requests": len(requests),
        "output_tokens": tokens,
        "seconds": elapsed,
        "output_tok_per_s": tokens / elapsed,
        "gpu_idle_fraction": max(0.0, 1 - busy / elapsed),
        **steps,
    }


# The server's two shapes, (row label, serve flags): the scheduler a thread of the server's
# process, or a process of its own.
SERVERS = {
    "thread": ("HTTP", ["--no-engine-process"]),
    "process": ("HTTP, engine process", ["--engine-process"]),
}


def _server_rows(
    label: str, command: list[str], offline: list[tuple[list[int], int]]
) -> list[dict[str, Any]]:
    """One fresh server's rows: its untimed first pass, then the workload streamed and not."""
    streams = (True, False)
    names = [f"{label}, httpx client, streamed (first pass, not compared)"]
    names += [f"{label}, httpx client, {'streamed' if stream else 'not streamed'}" for stream in streams]
    try:
        results = run_on_server(command, offline, streams, first_pass=True)
    except Exception as exc:  # the rows before still count
        failed = {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "output_tok_per_s": float("nan")}
        results = [failed] * len(names)
    return [{"path": name, **result} for name, result in zip(names, results)]


def _server_modes(value: str) -> list[str]:
    """`--servers thread,process`: which server shapes run, in order."""
    modes = [mode.strip() for mode in value.split(",") if mode.strip()]
    unknown = [mode for mode in modes if mode not in SERVERS]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"{value!r}: name server shapes from {', '.join(SERVERS)}, separated by commas"
        )
    return modes


def _stub_server_command(args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "snugkv.bench.stub_device", "--step-ms", str(args.stub_step_ms)]
    command += ["--prefill-us-per-token", str(args.prefill_us_per_token)]
    command += ["--max-batch", str(args.max_batch), "--chunk", str(args.chunk)]
    return command + (["--tokenizer", args.tokenizer] if args.tokenizer else [])


def _server_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--max-running-requests", str(args.max_batch), "--cuda-graph-max-bs", str(args.max_batch)]
    return [*flags, "--chunked-prefill-size", str(args.chunk)]


def run_fp8(args: argparse.Namespace) -> int:
    """bf16 against FP8 through the real server (see the module docstring)."""
    from snugkv.models.loader import read_model_config, resolve_model_source

    vocab = int(read_model_config(resolve_model_source(args.model, "dummy")).hf["vocab_size"])
    offline = workload(args.requests, seed=0, vocab=vocab, low=args.low, high=args.high)
    case = f"offline {args.requests} req, in/out U[{args.low},{args.high}], streamed"
    label, server_flags = SERVERS[args.servers[0]]
    rows: list[dict[str, Any]] = []
    for weights, extra in (("bf16", []), ("fp8", ["--quantization", args.quantization])):
        command = serve_command(args.model, _server_flags(args) + server_flags + extra)
        started = time.monotonic()
        try:
            (result,) = run_on_server(command, offline, (True,))
        except Exception as exc:  # the other row still counts
            result = {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "output_tok_per_s": float("nan")}
        rows.append(
            {
                "weights": weights,
                "path": label,
                "case": case,
                **result,
                "server_s": time.monotonic() - started,
            }
        )
    ratio = rows[1]["output_tok_per_s"] / rows[0]["output_tok_per_s"]
    emit(
        "http_fp8",
        rows,
        args.out,
        extra={"model": args.model, "fp8_over_bf16_tok_per_s": ratio, "target": 1.25},
    )
    print(f"FP8 over bf16, output tok/s through HTTP: {ratio:.3f}x (target >= 1.25x)")
    return 1 if any("error" in row for row in rows) else 0


def run(args: argparse.Namespace) -> int:
    if args.url is not None:
        return run_against_url(args)
    try:
        args.model = benchmark_model(args.model or "qwen3-0.6b")
    except argparse.ArgumentTypeError as exc:
        print(f"error: argument --model: {exc}", file=sys.stderr)
        return 2
    if args.quantization:
        if cuda_missing("bench http --quantization"):
            return 2
        logging.getLogger("httpx").setLevel(logging.WARNING)
        return run_fp8(args)
    stub = args.stub_step_ms is not None
    if not stub and cuda_missing("bench http", "pass --stub-step-ms to run on a stub device"):
        return 2
    torch.set_num_threads(1 if stub else torch.get_num_threads())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    rows: list[dict[str, Any]] = []
    case = f"offline {args.requests} req, in/out U[{args.low},{args.high}]"
    with tempfile.TemporaryDirectory() as directory:
        if stub:
            args.step_ms = args.stub_step_ms
            engine, tokenizer, llm = stub_engine(Path(directory), args), stub_tokenizer(args.tokenizer), None
        else:
            llm = bench_llm(args)
            engine, tokenizer = llm.engine, None
        vocab = 500 if stub else engine.config.vocab_size
        offline = workload(args.requests, seed=0, vocab=vocab, low=args.low, high=args.high)
        run_scheduler(engine, workload(16, seed=1, vocab=vocab, low=64, high=128))  # warm-up
        # The whole workload once untimed: its first pass meets kernels and shapes the short
        # warm-up does not (the HTTP server gets the same first pass), so the ratios compare warm runs.
        first = run_scheduler(engine, offline, tokenizer=tokenizer)
        in_process = run_scheduler(engine, offline, tokenizer=tokenizer)
        rows.append({"path": "scheduler, in process (first pass, not compared)", **first})
        rows.append({"path": "scheduler, in process", **in_process})
        rows.append(
            {"path": "AsyncEngine.generate, in process", **run_async_engine(engine, tokenizer, offline)}
        )
        del engine
        if llm is not None:
            llm.close()  # the server process needs the memory
        command = _stub_server_command(args) if stub else serve_command(args.model, _server_flags(args))
        for mode in args.servers:
            label, server_flags = SERVERS[mode]
            rows.extend(_server_rows(label, command + server_flags, offline))
    for row in rows:
        row["case"] = case
        row["over_in_process"] = row["output_tok_per_s"] / in_process["output_tok_per_s"]
    extra = {"device": f"stub, {args.stub_step_ms} ms/step" if stub else "cuda", "model": args.model}
    emit("http", rows, args.out, extra=extra)
    return 1 if any("error" in row for row in rows) else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="a shipped config or a path, without a stub (default: qwen3-0.6b); with --url: the served "
        "model's name (default: the first the server lists)",
    )
    parser.add_argument(
        "--servers",
        type=_server_modes,
        default=["thread", "process"],
        help="the server shapes to run: thread (the scheduler a thread of the server), process "
        "(--engine-process, serve's default); default: thread,process",
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument(
        "--quantization",
        choices=("fp8",),
        default=None,
        help="only the server (the first of --servers), bf16 then FP8 weights: output tok/s side by side",
    )
    parser.add_argument("--low", type=int, default=100, help="shortest input and output")
    parser.add_argument("--high", type=int, default=1024, help="longest input and output")
    parser.add_argument(
        "--stub-step-ms",
        type=float,
        default=None,
        help="replace the model forward by a stub device taking this long per decode step (runs on a CPU)",
    )
    add_stub_arguments(parser, with_step=False)
    add_url_arguments(parser)
