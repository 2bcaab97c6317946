"""`snugkv bench host-tier`: the KV cache's host tier (issue 35) on real servers, off and on.

Two `snugkv serve` of one shape, one after the other: the tier off (`--kv-host-tier-gib 0`), then on
(`--host-tier-gib`). Both get the same device KV cap (`--device-kv-tokens`: a lent machine's host
RAM cannot hold two or three times an uncapped device's KV), so the working sets below are sized
from the KV tokens the first server reports. On each, in this order (token-id prompts, streamed):
- `fits`: multi-turn chat whose sessions together hold `--fits-share` of the device KV (nothing
  leaves the device): the no-regression row;
- `chat`: `--sessions` x `--turns`, each turn the session's whole history and a new user turn,
  sessions interleaved, the turn size chosen so that all histories hold `--working-set` times the
  device KV (chat_load.py says how);
- `pressure`: prompts that fill `--fill-share` of the KV cache, then another process
  (bench/pressure_hog.py's co-tenant) takes all free memory but the server's headroom and then
  `--hog-gib` more (at most `HOG_SHARE` of the cache, and room for `REUSE_ROOM_PROMPTS` of the
  prompts left), step by step: the cache shrinks under pressure; the same prompts again while it
  holds that memory.
Each row: workload, tier, requests, failed, output tok/s, median (and p99) TTFT, the host hit rate
(host-hit tokens of the row over the prompt tokens the cache looked up, from `/server_info`
stats.host_tier; a request admitted again after waiting is looked up again), and what
moved between the tiers. The pressure row adds the moves (`GET /kv` events: shrinks, evicted and
dropped tokens, the time making room took). With the tier on, the chat row's host -> device load
bandwidth (bytes to the device over the copy stream's load seconds) is set beside a plain pinned
host -> device copy of `--copy-gib` measured in the same run once the servers are gone (GPU only;
device -> host likewise), and beside the copy micro-benchmark (bench/host_tier_copies.py): the
same `--copy-tokens` of the model's KV in scattered pages loaded and written through the tier's
two copy paths, per run and batched (GPU only; `*_over_pinned`: each load over the pinned copy). Raw JSON: `"benchmark": "host_tier"`. The exit code is 1 on any failed
request or a server that died.

On a GPU the shape is `--model` (default llama-3-8b, random weights); on a CPU the embedded SmolLM2
on a simulated shared device that the co-tenant takes from (a smoke test: tiny sizes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from snugkv.bench.chat_load import (
    TOKEN_HIGH,
    TOKEN_LOW,
    ChatShape,
    LoadResult,
    chat_shape,
    fitting_shape,
    run_chat,
    run_prompts,
)
from snugkv.bench.harness import emit, format_table
from snugkv.bench.host_tier_copies import copy_micro_bench
from snugkv.bench.idle import step_figures
from snugkv.bench.model_configs import benchmark_model
from snugkv.bench.pressure import CoTenant
from snugkv.bench.serving_http import start_server, stop_server
from snugkv.core.stack_sampler import SAMPLE_ENV
from snugkv.memory.host_device import HOST_DEVICE_ENV, HOST_HEADROOM_ENV, RUNTIME_DIR_ENV
from snugkv.memory.vmm import GIB, MIB

HOG_SHARE = 0.85  # the co-tenant takes at most this share of the committed KV cache,
REUSE_ROOM_PROMPTS = 4  # and leaves room for this many of the prompts sent again
WARM_UP_SESSIONS = 8  # chat sessions run on each server before its rows, not recorded
CPU_DEVICE_GIB = 0.5
CPU_HEADROOM_MIB = 24
# Defaults per device: (GPU, CPU)
DEFAULTS: dict[str, tuple[Any, Any]] = {
    # 24 GiB of the 8B shape's KV: histories of ~1,150 tokens at 512 sessions and a working set of 3x,
    # whose reuse saves a real prefill (at 98,304 tokens, the H100 run at be28b89, each history was
    # 576 tokens, which an 8B model recomputes about as fast as it loads their KV); the tier then
    # holds most of the rest within a lent machine's 128 GiB of RAM
    "device_kv_tokens": (196_608, 512),
    "host_tier_gib": (64.0, 0.05),
    "sessions": (512, 8),
    "turns": (8, 3),
    "output_tokens": (16, 4),
    "concurrency": (64, 4),
    "fill_tokens": (1024, 64),
    "hog_gib": (10.0, 0.01),
    # the other process's step: under pressure the engine keeps free at the driver only its headroom
    # less the workspace torch holds (~0.44 GiB for the 8B shape on an H100), so a 512 MiB step
    # could not be taken there, and the H100 run at be28b89 stalled its tier-off row at 1.1 GiB
    "hog_step_mib": (256.0, 1.0),
    "deadline_s": (120.0, 60.0),
}


def _progress(message: str) -> None:
    print(f"[bench host-tier {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- one server ---------------------------------------------------------------------------------
@dataclass
class Server:
    tier: str  # "on" or "off"
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def get(self, path: str) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}{path}", timeout=30.0).json())


def _serve_command(args: argparse.Namespace, tier_gib: float) -> list[str]:
    command = [sys.executable, "-m", "snugkv", "--log-level", "INFO", "serve", "--host", "127.0.0.1"]
    command += ["--device", args.device, "--kv-host-tier-gib", str(tier_gib)]
    command += ["--max-total-tokens", str(args.device_kv_tokens)]
    if args.model:
        from snugkv.bench.model_configs import benchmark_model

        command += ["--model", benchmark_model(args.model), "--load-format", "dummy"]
    if args.device == "cpu":  # the KV cache on the simulated device the co-tenant shares, in 64 KiB
        # extensions (a buffer of a small cache in one extension could only shrink to nothing)
        command += ["--host-kv-gib", str(CPU_DEVICE_GIB), "--kv-chunk-mib", "0.0625"]
    return command + args.serve_args.split()


def _tier_stats(info: dict[str, Any]) -> dict[str, Any]:
    return dict(info.get("stats", {}).get("host_tier") or {})


def _moved(before: dict[str, Any], after: dict[str, Any], prompt_tokens: int, tier: str) -> dict[str, Any]:
    """The tier's counters over a row: hit rates over the tokens looked up, tokens moved."""
    a, b = _tier_stats(after), _tier_stats(before)

    def delta(key: str) -> float:
        return float(a.get(key, 0) - b.get(key, 0))

    if tier == "off" or not a:
        return {"host_hit_rate": None, "device_hit_rate": None}
    looked_up = delta("query_tokens")  # a request admitted again (it waited for memory) counts again
    return {
        "host_hit_rate": delta("host_hit_tokens") / looked_up if looked_up else 0.0,
        "device_hit_rate": delta("device_hit_tokens") / looked_up if looked_up else 0.0,
        "looked_up_over_prompt": looked_up / prompt_tokens if prompt_tokens else None,
        "spilled_tokens": int(delta("spilled_tokens")),
        "dropped_tokens": int(delta("dropped_tokens")),
        "budget_dropped_tokens": int(delta("budget_dropped_tokens")),
        "gib_to_device": delta("bytes_to_device") / GIB,
        "load_gb_per_s": delta("bytes_to_device") / delta("load_s") / 1e9 if delta("load_s") > 0 else None,
        "write_gb_per_s": delta("bytes_to_host") / delta("write_s") / 1e9 if delta("write_s") > 0 else None,
    }


def _row(workload: str, server: Server, shape: ChatShape | None, result: LoadResult,
         before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    row: dict[str, Any] = {"workload": workload, "tier": server.tier}
    if shape is not None:
        row.update(
            sessions=shape.sessions, turns=shape.turns, turn_tokens=shape.user_tokens + shape.output_tokens
        )
    row.update(result.columns())
    row.update(_moved(before, after, result.prompt_tokens, server.tier))
    row["retractions"] = after["stats"]["num_retractions"] - before["stats"]["num_retractions"]
    row["_errors"] = result.errors
    return row


def _chat(
    server: Server, workload: str, shape: ChatShape, args: argparse.Namespace, salt: int
) -> dict[str, Any]:
    _progress(f"tier {server.tier}: {workload}, {shape.sessions} sessions x {shape.turns} turns "
              f"of {shape.user_tokens} + {shape.output_tokens} tokens")  # fmt: skip
    before = server.get("/server_info")
    start = time.monotonic()
    result = asyncio.run(
        run_chat(server.url, shape, concurrency=min(args.concurrency, shape.sessions),
                 deadline_s=args.deadline_s, salt=salt)
    )  # fmt: skip
    end = time.monotonic()
    after = server.get("/server_info?steps=true")
    row = _row(workload, server, shape, result, before, after)
    # where the row's device time went (the server's last steps): prefill (mixed steps count
    # here) against decode steps, and the device idle between them
    row.update(step_figures(after.get("recent_steps", []), start, end))
    host_wait = after.get("step_times", {}).get("host_wait_s", 0.0) - before.get("step_times", {}).get(
        "host_wait_s", 0.0
    )
    row["host_wait_s"] = host_wait  # the scheduler waiting for step results: near zero when the host bounds
    return row


def _warm_up(server: Server, fits: ChatShape, args: argparse.Namespace) -> None:
    """A few sessions of the `fits` shape, not recorded: prefix hits and the turn sizes run once
    before the first row, so that no row pays a first use (a kernel's compile on a fresh machine,
    a first allocation). On the H100 at be28b89 the `fits` row of the server started first had a
    p99 TTFT of 5.4 s against 2.2 s on the second."""
    shape = ChatShape(
        min(WARM_UP_SESSIONS, fits.sessions), min(3, fits.turns), fits.user_tokens, fits.output_tokens
    )
    asyncio.run(run_chat(server.url, shape, concurrency=shape.sessions, deadline_s=args.deadline_s, salt=99))


# -- the pressure row ---------------------------------------------------------------------------
def _ask(tenant: CoTenant, command: str, timeout_s: float) -> dict[str, Any] | None:
    """The co-tenant's answer, or None when it has none within `timeout_s` (it is killed then)."""
    answer: list[dict[str, Any]] = []

    def ask() -> None:
        with contextlib.suppress(RuntimeError, OSError, ValueError):  # killed meanwhile
            answer.append(tenant.ask(command))

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not answer:
        tenant.process.kill()
        return None
    return answer[0]


def _pressure(server: Server, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    kv = server.get("/kv")
    count = max(1, int(args.fill_share * kv["max_total_num_tokens"] // (args.fill_tokens + 1)))
    prompts = [_fill_prompt(index, args.fill_tokens) for index in range(count)]
    _progress(f"tier {server.tier}: pressure, {count} prompts of {args.fill_tokens} tokens fill the cache")
    fill = asyncio.run(run_prompts(server.url, prompts, 1, concurrency=args.concurrency))
    kv = server.get("/kv")
    seen = len(kv["events"])
    step = int(args.hog_step_mib * MIB)
    # what stays must hold a few of the prompts sent again, or none of them could run
    kept_bytes = int(REUSE_ROOM_PROMPTS * (args.fill_tokens + args.output_tokens) * kv["bytes_per_token"])
    hog_bytes = min(
        int(args.hog_gib * GIB), int(HOG_SHARE * kv["committed_bytes"]), kv["committed_bytes"] - kept_bytes
    )
    hog_bytes = max(hog_bytes, 0) // step * step
    tenant = CoTenant("cuda" if args.device.startswith("cuda") else "cpu", env)
    taken = 0
    try:
        # all free memory but the server's headroom (no shrink yet), then hog_bytes of its KV cache
        first = _ask(tenant, f"all-but {kv['headroom_bytes']}", 60.0)
        grown = first and _ask(tenant, f"grow {step} 20 {first['held_bytes'] + hog_bytes}", args.deadline_s)
        taken = int(grown["held_bytes"] - first["held_bytes"]) if first and grown else 0
        _progress(f"tier {server.tier}: the other process took {taken / GIB:.2f} GiB beyond the headroom")
        before = server.get("/server_info")
        again = asyncio.run(
            run_prompts(server.url, prompts, args.output_tokens, concurrency=args.concurrency)
        )
        after = server.get("/server_info")
        events = [e for e in server.get("/kv")["events"][seen:] if e["reason"] == "pressure"]
    finally:
        tenant.exit()
    row = _row("pressure", server, None, again, before, after)
    row.update(
        failed=again.failed + fill.failed,
        fill_requests=fill.requests,
        taken_gib=round(taken / GIB, 3),
        shrinks=len(events),
        evicted_tokens=sum(e["evicted_tokens"] for e in events),
        shrink_dropped_tokens=sum(e.get("dropped_tokens", 0) for e in events),
        max_room_ms=max((e.get("room_ms", 0.0) for e in events), default=0.0),
        max_move_ms=max((e.get("room_ms", 0.0) + e["took_ms"] for e in events), default=0.0),
    )
    row["_errors"] = fill.errors + again.errors
    row["_events"] = events
    return row


def _fill_prompt(index: int, tokens: int) -> list[int]:
    rng = random.Random(f"fill-{index}")
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(tokens)]


# -- the run ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Shapes:
    kv_tokens: int
    chat: ChatShape
    fits: ChatShape


def _shapes(args: argparse.Namespace, info: dict[str, Any]) -> Shapes:
    kv_tokens = int(info["max_total_num_tokens"])
    chat = chat_shape(kv_tokens, args.sessions, args.turns, args.output_tokens, args.working_set)
    longest = chat.session_tokens + chat.output_tokens
    if longest > int(info["context_length"]):
        raise SystemExit(
            f"error: a session's history reaches {longest} tokens, beyond the context length "
            f"{info['context_length']}; ask for more --sessions or a smaller --working-set"
        )
    return Shapes(kv_tokens, chat, fitting_shape(chat, kv_tokens, args.fits_share))


def _one_server(
    args: argparse.Namespace, env: dict[str, str], tier: str, runtime: Path, shapes: Shapes | None
) -> tuple[list[dict[str, Any]], Shapes, dict[str, Any]]:
    tier_gib = args.host_tier_gib if tier == "on" else 0.0
    log_path = runtime / f"server-tier-{tier}.log"
    with open(log_path, "wb") as log:
        _progress(f"tier {tier}: starting the server")
        if args.sample_scheduler:  # where the scheduler thread's wall time goes, for the server's life
            env = {**env, SAMPLE_ENV: str(runtime / f"scheduler-tier-{tier}.txt")}
        process, url = start_server(_serve_command(args, tier_gib), timeout_s=600.0, env=env, log=log)
        server = Server(tier, process, url, log_path)
        try:
            info = server.get("/server_info")
            shapes = shapes or _shapes(args, info)
            asyncio.run(run_prompts(url, [[7 + i, *range(10, 70)] for i in range(8)], 4, concurrency=8))
            _warm_up(server, shapes.fits, args)
            workloads = args.workloads.split(",")
            rows = [_chat(server, "fits", shapes.fits, args, salt=1)] if "fits" in workloads else []
            rows += [_chat(server, "chat", shapes.chat, args, salt=2)] if "chat" in workloads else []
            rows += [_pressure(server, args, env)] if "pressure" in workloads else []
            for row in rows:
                row["server_alive"] = process.poll() is None
            summary = {
                "max_total_num_tokens": info["max_total_num_tokens"],
                "host_tier": _tier_stats(server.get("/server_info")),
            }
        finally:
            stop_server(process)
    return rows, shapes, summary


def _pinned_copies(size_gib: float) -> dict[str, float]:
    """A plain pinned host <-> device copy of `size_gib`, GB/s each way (GPU only)."""
    import torch

    from snugkv.bench.harness import time_cuda

    size = int(size_gib * GIB)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    to_device = time_cuda(lambda: device.copy_(host, non_blocking=True), iterations=10, warmup=2)
    to_host = time_cuda(lambda: host.copy_(device, non_blocking=True), iterations=10, warmup=2)
    return {"pinned_h2d_gb_per_s": size / to_device / 1e9, "pinned_d2h_gb_per_s": size / to_host / 1e9}


def _copy_paths(args: argparse.Namespace) -> dict[str, Any]:
    """The copy micro-benchmark at the model's shape and the servers' default page (GPU only)."""
    import torch

    from snugkv.engine import EngineArgs

    page_size = EngineArgs.of(device=args.device).cache.page_size
    return copy_micro_bench(
        benchmark_model(args.model),
        tokens=args.copy_tokens,
        page_size=page_size,
        device=torch.device(args.device),
    )


def _bandwidth(rows: list[dict[str, Any]], pinned: dict[str, float], paths: dict[str, Any]) -> dict[str, Any]:
    chat = next((r for r in rows if r["workload"] == "chat" and r["tier"] == "on"), {})
    load, write = chat.get("load_gb_per_s"), chat.get("write_gb_per_s")
    h2d, d2h = pinned.get("pinned_h2d_gb_per_s"), pinned.get("pinned_d2h_gb_per_s")
    over = {}
    for path in ("per_run", "batched"):
        path_load, path_write = paths.get(f"{path}_load_gb_per_s"), paths.get(f"{path}_write_gb_per_s")
        if path_load is not None:
            over[f"{path}_load_over_pinned"] = path_load / h2d if h2d else None
            over[f"{path}_write_over_pinned"] = path_write / d2h if path_write and d2h else None
    return {
        "tier_load_gb_per_s": load,
        "tier_write_gb_per_s": write,
        **pinned,
        "load_over_pinned": load / h2d if load and h2d else None,
        "write_over_pinned": write / d2h if write and d2h else None,
        **paths,
        **over,
    }


def run(args: argparse.Namespace) -> int:
    # a step's `timeout` sends SIGTERM: the servers are stopped on the way out (`finally`), not left
    # holding the device for the next step
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device.startswith("cuda")
    for name, (on_gpu, on_cpu) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, on_gpu if gpu else on_cpu)
    if args.model is None and gpu:
        args.model = "llama-3-8b"
    unknown = set(args.workloads.split(",")) - {"fits", "chat", "pressure"}
    if unknown:
        raise SystemExit(
            f"--workloads: no such workload {sorted(unknown)}; choose among fits, chat, pressure"
        )
    rows: list[dict[str, Any]] = []
    servers: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="snugkv-host-tier-") as directory:
        runtime = Path(args.out) if args.out else Path(directory)  # a cut run keeps the server logs
        runtime.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "TQDM_DISABLE": "1"}
        env.pop("SNUGKV_API_KEY", None)
        if not gpu:  # one simulated device the servers and the co-tenant share
            env[HOST_DEVICE_ENV] = str(CPU_DEVICE_GIB)
            env.setdefault(HOST_HEADROOM_ENV, str(CPU_HEADROOM_MIB))
            env[RUNTIME_DIR_ENV] = str(Path(directory) / "run")
        shapes: Shapes | None = None
        try:
            for tier in args.tiers.split(","):
                tier_rows, shapes, servers[tier] = _one_server(args, env, tier, runtime, shapes)
                rows += tier_rows
        except Exception:
            for log in sorted(runtime.glob("server-tier-*.log")):
                print(f"{log.name} ends:\n{log.read_text(errors='replace')[-4000:]}", file=sys.stderr)
            raise
        logs = "".join(log.read_text(errors="replace") for log in sorted(runtime.glob("server-tier-*.log")))
    pinned = _pinned_copies(args.copy_gib) if gpu and args.copy_gib > 0 else {}
    paths: dict[str, Any] = {}
    if gpu and args.copy_gib > 0:
        try:  # the servers' rows are what the run is for: a failed micro-benchmark is a line in the JSON
            paths = _copy_paths(args)
        except Exception as exc:
            paths = {"copy_bench_error": f"{type(exc).__name__}: {exc}"}
    rows.sort(key=lambda row: (["fits", "chat", "pressure"].index(row["workload"]), row["tier"]))
    details = [{key: row.pop(key) for key in ("_errors", "_events") if key in row} for row in rows]
    assert shapes is not None
    bandwidth = _bandwidth(rows, pinned, paths)
    extra = {
        "shapes": {
            "device_kv_tokens": shapes.kv_tokens,
            "chat": asdict(shapes.chat),
            "fits": asdict(shapes.fits),
        },
        "flags": {
            name: getattr(args, name) for name in (*DEFAULTS, "host_tier_gib", "working_set", "fits_share")
        },
        "bandwidth": bandwidth,
        "servers": servers,
        "details": details,
        "server_log_tracebacks": logs.count("Traceback"),
        "server_log_host_tier_lines": [line for line in logs.splitlines() if "Host KV tier" in line],
    }
    emit("host_tier", rows, args.out, extra=extra)
    print("\nbandwidth (GB/s)")
    print(format_table([bandwidth]))
    for row, detail in zip(rows, details, strict=True):
        for error in detail.get("_errors", []):
            print(f"{row['workload']}/{row['tier']}: {error}")
    failed = any(row["failed"] or not row["server_alive"] for row in rows)
    return 1 if failed else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    def default(name: str) -> str:
        on_gpu, on_cpu = DEFAULTS[name]
        return f"(default: {on_gpu} on a GPU, {on_cpu} on a CPU)"

    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--model", default=None, help="a shipped shape or model directory, random weights "
                        "(default on a GPU: llama-3-8b; on a CPU: the embedded SmolLM2)")  # fmt: skip
    parser.add_argument("--device-kv-tokens", type=int, default=None,
                        help=f"both servers' --max-total-tokens {default('device_kv_tokens')}")  # fmt: skip
    parser.add_argument("--host-tier-gib", type=float, default=None,
                        help=f"the tier-on server's --kv-host-tier-gib {default('host_tier_gib')}")  # fmt: skip
    parser.add_argument("--sessions", type=int, default=None, help=f"chat sessions {default('sessions')}")
    parser.add_argument("--turns", type=int, default=None, help=f"turns a session {default('turns')}")
    parser.add_argument(
        "--output-tokens", type=int, default=None, help=f"a turn's answer {default('output_tokens')}"
    )
    parser.add_argument("--working-set", type=float, default=3.0,
                        help="chat: all histories over the device KV tokens (default: 3)")  # fmt: skip
    parser.add_argument("--fits-share", type=float, default=0.5,
                        help="fits: all histories over the device KV tokens (default: 0.5)")  # fmt: skip
    parser.add_argument(
        "--concurrency", type=int, default=None, help=f"requests in flight {default('concurrency')}"
    )
    parser.add_argument("--deadline-s", type=float, default=None,
                        help=f"no turn of a chat workload starts after this {default('deadline_s')}")  # fmt: skip
    parser.add_argument("--fill-tokens", type=int, default=None,
                        help=f"pressure: each filling prompt {default('fill_tokens')}")  # fmt: skip
    parser.add_argument(
        "--fill-share", type=float, default=0.9, help="pressure: of the KV cache filled (0.9)"
    )
    parser.add_argument("--hog-gib", type=float, default=None,
                        help=f"pressure: taken beyond the headroom, at most {HOG_SHARE:g} of the cache "
                        f"{default('hog_gib')}")  # fmt: skip
    parser.add_argument("--hog-step-mib", type=float, default=None,
                        help=f"pressure: the other process's step {default('hog_step_mib')}")  # fmt: skip
    parser.add_argument("--copy-gib", type=float, default=1.0,
                        help="the plain pinned copy (GPU, default: 1; 0: neither it nor the copy micro-benchmark)")  # fmt: skip
    parser.add_argument("--tiers", default="off,on", choices=["off,on", "on", "off"],
                        help="the servers to run (default: off,on; one alone is a diagnostic, no ratio)")  # fmt: skip
    parser.add_argument("--workloads", default="fits,chat,pressure",
                        help="which rows, comma-separated (default: fits,chat,pressure)")  # fmt: skip
    parser.add_argument("--copy-tokens", type=int, default=4000,
                        help="the copy micro-benchmark's tokens, in scattered pages (GPU, default: 4000)")  # fmt: skip
    parser.add_argument("--serve-args", default="", help="more `snugkv serve` flags for both servers")
    parser.add_argument("--sample-scheduler", action="store_true",
                        help="sample each server's scheduler thread (core/stack_sampler.py) into "
                        "scheduler-tier-{off,on}.txt beside the server logs")  # fmt: skip
