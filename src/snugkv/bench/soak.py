"""`snugkv bench soak`: a real server under a mixed load and memory churn for M minutes; nothing may leak.

A fresh `snugkv serve` starts (or `--url` names one already running) and, for `--minutes` (fractions
allowed), `--concurrency` clients send the kinds of `soak_load` in turn: completions and chat,
streamed and not, n > 1, penalties, prompt scoring (echo + logprobs, max_tokens 0), structured
output (json_schema, only where xgrammar imports), streams dropped at the socket and streams closed
early. Beside them one control loop (`soak_controls`), every `--control-every-s`, in turn:
- resizes the KV cache (`POST /kv/resize` to half its start size, then back);
- puts the engine to sleep and wakes it (`POST /sleep?level=1`, `POST /wake_up`); new requests
  wait at the client while the engine drains and sleeps (a request sent to a sleeping engine gets
  a 503 by design, and a 503 here must mean a fault);
- makes room for another process (`{"free_gib": --hog-gib}`, 1 GiB more on CUDA for the other
  process's context), runs one that takes that memory and gives it back (`soak_hog`: a torch
  tensor on CUDA, a holding on the simulated shared device on a CPU), then grows the KV cache back.

At the end, with the load stopped, the engine awake and grown back to its start size and one more
request finished, the report (a printed table; `--json PATH` and `--out DIR` save it) has: requests
by kind and outcome (200 / 4xx / 5xx / client-cut / client-error), the leaked KV slots (the
server's idle slot check, `GET /server_info` `slot_accounting_when_idle`: capacity - free -
cached, and `GET /kv`: used - cached and what requests still hold), the server's host RSS (its
process and the engine's) at start and end, the committed KV bytes and the device's free bytes from
`GET /kv` at start and end, and p50/p99 latency of the answered requests per minute (per 10 s
when M < 2). The exit code is 1 when any 5xx, client error or leaked slot is seen.

The start figures are taken after one request of each kind (first-use compiles and allocations
are not drift). A server without a tokenizer (random weights of a shipped shape) gets token-id
prompts, and the kinds that need text (chat, scoring, structured output) are skipped and named in
the report. What the soak knows of the server comes from its HTTP routes and, for the RSS, /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import logging
import math
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from snugkv.bench.harness import client_limits, emit, environment, format_table, save
from snugkv.bench.serving_http import serve_command, start_server, stop_server
from snugkv.bench.soak_controls import DRAIN_TIMEOUT_S, SoakState, control_call, run_controls
from snugkv.bench.soak_load import KINDS, OUTCOMES, TEXT_KINDS, Target, send
from snugkv.bench.soak_report import latency_windows, leaked_slots, outcome_rows, process_rss_bytes
from snugkv.memory.host_device import HOST_DEVICE_ENV, RUNTIME_DIR_ENV
from snugkv.memory.vmm import GIB

logger = logging.getLogger(__name__)

CPU_HOST_KV_GIB = 0.25
CPU_HOG_GIB = 0.1
CUDA_HOG_GIB = 8.0


async def _client(
    client: httpx.AsyncClient,
    target: Target,
    kinds: itertools.cycle[str],
    state: SoakState,
    stop_at: float,
    seed: int,
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        await state.awake.wait()
        state.in_flight += 1
        try:
            state.outcomes.append(await send(client, target, next(kinds), rng))
        finally:
            state.in_flight -= 1


async def _sample_rss(
    state: SoakState, pids: dict[str, int], window_s: float, began: float, stop_at: float
) -> None:
    """The processes' RSS at the end of each latency window: a leak is a trend, not a difference."""
    for index in itertools.count(1):
        end = min(began + index * window_s, stop_at)
        await asyncio.sleep(max(end - time.monotonic(), 0.0))
        state.rss_samples.append({name: process_rss_bytes(pid) for name, pid in pids.items()})
        if end >= stop_at:
            return


async def _wait_idle(client: httpx.AsyncClient, timeout_s: float = DRAIN_TIMEOUT_S) -> dict[str, Any]:
    """GET /kv once nothing runs or waits (then a moment more: the idle slot check runs between steps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        kv = (await client.get("/kv")).json()
        if kv["num_running_requests"] == 0 and kv["num_queued_requests"] == 0:
            await asyncio.sleep(0.5)
            return dict((await client.get("/kv")).json())
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not idle after {timeout_s:.0f} s: {kv}")
        await asyncio.sleep(0.1)


async def _snapshot(client: httpx.AsyncClient, server_pid: int | None) -> dict[str, Any]:
    """The server's memory when idle: its KV cache, its device's free bytes, the host RSS."""
    kv = await _wait_idle(client)
    info = (await client.get("/server_info")).json()
    engine_pid = (info.get("engine_process") or {}).get("pid")
    return {
        "kv": kv,
        "info": info,
        "engine_pid": engine_pid,
        "server_rss_bytes": process_rss_bytes(server_pid) if server_pid else None,
        "engine_rss_bytes": process_rss_bytes(engine_pid) if engine_pid else None,
    }


async def _probe_target(client: httpx.AsyncClient, url: str, model: str | None) -> Target:
    served = model or (await client.get("/v1/models")).json()["data"][0]["id"]
    text = await client.post("/v1/completions", json={"model": served, "prompt": "Hello", "max_tokens": 1})
    if text.status_code != 200:  # no tokenizer (a 400 saying to send token ids): do they work?
        ids = await client.post(
            "/v1/completions", json={"model": served, "prompt": [1, 2, 3], "max_tokens": 1}
        )
        ids.raise_for_status()
    return Target(url, served, has_tokenizer=text.status_code == 200)


async def _soak(
    args: argparse.Namespace, url: str, server_pid: int | None, hog_env: dict[str, str]
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = client_limits(args.concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=300.0, limits=limits, headers=headers) as client:
        target = await _probe_target(client, url, args.served_model)
        skipped = {kind: "the server has no tokenizer (token-id prompts only)" for kind in sorted(TEXT_KINDS)}
        if target.has_tokenizer:
            skipped = {}
        if importlib.util.find_spec("xgrammar") is None:
            skipped["structured"] = "xgrammar is not importable here"
        kinds = [kind for kind in KINDS if kind not in skipped]
        # One of each kind before the start figures: first-use allocations and compiles (a
        # grammar's, a sampler's) are not drift.
        untimed = list(
            await asyncio.gather(*(send(client, target, kind, random.Random(-1)) for kind in kinds))
        )
        start = await _snapshot(client, server_pid)
        start_tokens = int(start["kv"]["max_total_num_tokens"])
        state = SoakState()
        state.awake.set()
        began = time.monotonic()
        stop_at = began + args.minutes * 60
        cycle = itertools.cycle(kinds)
        clients = [_client(client, target, cycle, state, stop_at, seed) for seed in range(args.concurrency)]
        pids = {"server_rss_mib": server_pid, "engine_rss_mib": start["engine_pid"]}
        sampler = _sample_rss(
            state, {name: pid for name, pid in pids.items() if pid}, _window_s(args), began, stop_at
        )
        await asyncio.gather(
            run_controls(client, state, args, start_tokens, stop_at, hog_env), sampler, *clients
        )
        seconds = time.monotonic() - began
        # Back to the start: awake, the start size, one more request (the idle slot check runs again).
        if (await client.get("/is_sleeping")).json().get("is_sleeping"):
            await control_call(client, state, "wake", "POST", "/wake_up")
        kv_now = (await client.get("/kv")).json()
        if kv_now["max_total_num_tokens"] != start_tokens:
            await control_call(
                client, state, "resize", "POST", "/kv/resize", json={"max_total_num_tokens": start_tokens}
            )
        untimed.append(await send(client, target, "completion", random.Random(-2)))
        end = await _snapshot(client, server_pid)
    return {
        "untimed": untimed,
        "target": target,
        "skipped": skipped,
        "start": start,
        "end": end,
        "state": state,
        "seconds": seconds,
        "began": began,
    }


def _window_s(args: argparse.Namespace) -> float:
    return 10.0 if args.minutes < 2 else 60.0


def _summary(result: dict[str, Any], args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    state: SoakState = result["state"]
    start, end = result["start"], result["end"]
    leaks = leaked_slots(end["info"], end["kv"])
    rows = outcome_rows(state.outcomes, state.controls)
    window_s = _window_s(args)
    windows = max(1, math.ceil(args.minutes * 60 / window_s))
    latency = latency_windows(state.outcomes, result["began"], window_s, windows)
    for window, sample in zip(latency, state.rss_samples):
        window.update({name: None if rss is None else rss / 2**20 for name, rss in sample.items()})
    counts = {outcome: sum(row[outcome] for row in rows) for outcome in OUTCOMES}
    summary = {
        "minutes": args.minutes,
        "seconds": result["seconds"],
        "model": result["target"].model,
        "has_tokenizer": result["target"].has_tokenizer,
        "skipped_kinds": result["skipped"],
        "totals": counts,
        "leaked_slots": leaks,
        "resizes_ok": sum(1 for o in state.controls if o.kind == "resize" and o.outcome == "200"),
        "sleep_wake_cycles": sum(1 for o in state.controls if o.kind == "wake" and o.outcome == "200"),
        "hog_cycles": len(state.hog_held_bytes),
        "hog_asked_bytes": int(args.hog_gib * GIB),
        "hog_held_bytes": state.hog_held_bytes,
        # one of each kind before the start figures, one completion after the load
        "untimed": {name: sum(1 for o in result["untimed"] if o.outcome == name) for name in OUTCOMES},
        "untimed_by_kind": {o.kind: o.outcome for o in result["untimed"][:-1]},  # the round of each kind
        "server_log_tracebacks": result.get("server_log_tracebacks"),
        "server_rss_bytes": {"start": start["server_rss_bytes"], "end": end["server_rss_bytes"]},
        "engine_rss_bytes": {"start": start["engine_rss_bytes"], "end": end["engine_rss_bytes"]},
        "kv_committed_bytes": {"start": start["kv"]["committed_bytes"], "end": end["kv"]["committed_bytes"]},
        "kv_tokens": {"start": start["kv"]["max_total_num_tokens"], "end": end["kv"]["max_total_num_tokens"]},
        "device_free_bytes": {
            "start": start["kv"]["device_free_bytes"],
            "end": end["kv"]["device_free_bytes"],
        },
        "step_errors": {"start": start["info"].get("step_errors"), "end": end["info"].get("step_errors")},
        "latency_window_s": window_s,
        "latency": latency,
        "failures": [
            {"kind": o.kind, "outcome": o.outcome, "detail": o.detail}
            for o in [*result["untimed"], *state.outcomes, *state.controls]
            if o.outcome in ("5xx", "client-error")
        ][:20],
    }
    return rows, summary


def _memory_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name in ("server_rss_bytes", "engine_rss_bytes", "kv_committed_bytes", "device_free_bytes"):
        start, end = summary[name]["start"], summary[name]["end"]
        if start is None or end is None:
            continue
        rows.append(
            {
                "memory": name,
                "start_mib": start / 2**20,
                "end_mib": end / 2**20,
                "drift_mib": (end - start) / 2**20,
            }
        )
    return rows


def _print_report(summary: dict[str, Any]) -> None:
    print(format_table(_memory_rows(summary)))
    print(format_table(summary["latency"]))
    leaks = summary["leaked_slots"]
    print(
        f"leaked KV slots: {leaks['leaked']} ({leaks['detail']}) · resizes {summary['resizes_ok']} · "
        f"sleep/wake {summary['sleep_wake_cycles']} · hog cycles {summary['hog_cycles']}"
    )
    for kind, why in summary["skipped_kinds"].items():
        print(f"skipped {kind}: {why}")
    for failure in summary["failures"]:
        print(f"FAILED {failure['kind']} ({failure['outcome']}): {failure['detail']}")


def _server_command(args: argparse.Namespace) -> list[str]:
    extra = ["--device", args.device]
    if args.kv_chunk_mib or args.device == "cpu":  # a CPU's small KV cache: 1 MiB chunks shrink finely
        extra += ["--kv-chunk-mib", str(args.kv_chunk_mib or 1)]
    if args.max_running_requests:
        extra += ["--max-running-requests", str(args.max_running_requests)]
    if args.device == "cpu":
        extra += ["--host-kv-gib", str(args.host_kv_gib)]
    extra += shlex.split(args.serve_args)
    if args.model:
        from snugkv.bench.model_configs import benchmark_model

        return serve_command(benchmark_model(args.model), extra)  # random weights of a shipped shape
    # the embedded default model (SmolLM2), its real weights and tokenizer
    return [sys.executable, "-m", "snugkv", "--log-level", "WARNING", "serve", "--host", "127.0.0.1", *extra]


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.minutes <= 0:
        print("error: --minutes must be above 0 (fractions such as 0.5 are fine)", file=sys.stderr)
        return 2
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.hog_device = "cuda" if args.device.startswith("cuda") else "cpu"
    if args.control_every_s is None:
        args.control_every_s = max(3.0, min(30.0, args.minutes * 60 / 9))
    if args.hog_gib is None:
        args.hog_gib = CUDA_HOG_GIB if args.hog_device == "cuda" else CPU_HOG_GIB
    with tempfile.TemporaryDirectory(prefix="snugkv-soak-") as runtime:
        env = dict(os.environ)
        if args.hog_device == "cpu" and args.url is None:
            # One simulated device the server and the hog share, no larger than the KV cache: the
            # hog gets only what the server gave back.
            env[HOST_DEVICE_ENV] = str(args.host_kv_gib)
            env[RUNTIME_DIR_ENV] = runtime
        if args.hog_device == "cpu" and HOST_DEVICE_ENV not in env:
            print(f"--url on a CPU: no {HOST_DEVICE_ENV} to share, so no memory hog", file=sys.stderr)
            args.hog_gib = 0.0
        if args.url is not None:
            result = asyncio.run(_soak(args, args.url.rstrip("/"), None, env))
        else:
            log_path = Path(runtime) / "server.log"
            with open(log_path, "wb") as log:
                try:
                    process, url = start_server(_server_command(args), env=env, log=log)
                    try:
                        result = asyncio.run(_soak(args, url, process.pid, env))
                    finally:
                        stop_server(process)
                except Exception:
                    tail = log_path.read_text(errors="replace")[-4000:]
                    print(f"the server's log ends:\n{tail}", file=sys.stderr)
                    raise
            result["server_log_tracebacks"] = log_path.read_text(errors="replace").count("Traceback")
    rows, summary = _summary(result, args)
    emit("soak", rows, args.out, extra=summary)
    _print_report(summary)
    if args.json:
        save(Path(args.json), {"environment": environment(), "rows": rows, **summary})
    failed = summary["failures"] or summary["leaked_slots"]["leaked"]
    return 1 if failed else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--minutes", type=float, default=10.0, help="how long the load runs (default: 10; 0.5 is fine)"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a shipped config or path, random weights (e.g. llama-3-8b); default: the embedded SmolLM2",
    )
    parser.add_argument(
        "--device", default=None, help="the server's device (default: cuda if present, else cpu)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=4, help="clients sending requests at once (default: 4)"
    )
    parser.add_argument("--max-running-requests", type=int, default=None, help="passed to serve")
    parser.add_argument(
        "--kv-chunk-mib",
        type=float,
        default=None,
        help="passed to serve (default: 1 on a CPU, serve's on CUDA)",
    )
    parser.add_argument(
        "--host-kv-gib",
        type=float,
        default=CPU_HOST_KV_GIB,
        help=f"CPU: the KV cache's RAM (default: {CPU_HOST_KV_GIB})",
    )
    parser.add_argument("--serve-args", default="", help="more flags for serve, one string (e.g. '--tp 2')")
    parser.add_argument(
        "--control-every-s",
        type=float,
        default=None,
        help="seconds between the resize, sleep/wake and hog cycles (default: the run's length / 9, 3 to 30)",
    )
    parser.add_argument(
        "--hog-gib",
        type=float,
        default=None,
        help=f"memory the other process takes (default: {CUDA_HOG_GIB:g} on CUDA, {CPU_HOG_GIB:g} on a CPU; 0: none)",
    )
    parser.add_argument("--url", default=None, help="soak this running snugkv server instead of starting one")
    parser.add_argument(
        "--served-model", default=None, help="--url: the model name (default: the first listed)"
    )
    parser.add_argument("--api-key", default=os.environ.get("SNUGKV_API_KEY"), help="--url: the server's key")
    parser.add_argument("--json", default=None, help="write the report to this JSON file")
