"""`snugkv bench pressure`: a default `snugkv serve` keeps serving while another process takes its memory.

The other process (`pressure_hog`) is a separate program that allocates with plain CUDA driver
calls (`cuMemAlloc`), not through torch nor anything of snugkv's; the server runs with its default
flags. Through every scenario `--long` clients send prompts of `--long-tokens` tokens and `--short`
clients prompts of `--short-tokens`, each streamed with `--output-tokens` fixed-length outputs
(`ignore_eos`), one after another until the scenario ends (so that many are in flight throughout):
- `all-but`: once the streams run, the other process takes all the free device memory but
  `--leave-mib` in one allocation, holds it `--hold-s`, then frees it;
- `grow`: it allocates `--step-mib` every `--every-ms` up to `--grow-gib`, holds `--grow-hold-s`,
  then frees everything at once;
- `start`: `all-but` on a fresh server at its start-up, as soon as it logs its KV sizing (between
  the sizing and the first request); the load starts once the server is healthy.
Each scenario's row: requests by outcome (complete, 5xx, 4xx, truncated streams, client errors),
KV tokens and committed bytes at the start, the lowest during and after, what the other process
got, the KV cache's moves (`GET /kv` events: pressure shrinks and grows, each with its ms and
the bytes each shrink released against those it needed: the headroom less the free memory it
measured), and the seconds from the other process's exit to
the KV cache being back within 1% of its start size. The exit code is 1 on any 5xx, truncated
stream or client error, or when the server died.

On a GPU the server is `--model` (default the Llama-3-8B shape, random weights) and the prompts are
token ids; on a CPU the embedded SmolLM2 on a simulated shared device (`SNUGKV_HOST_DEVICE_GIB`),
which the CPU co-tenant takes from.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from snugkv.bench.harness import client_limits, emit, format_table
from snugkv.bench.serving_http import stop_server
from snugkv.distributed.launch import free_port
from snugkv.memory.host_device import HOST_DEVICE_ENV, HOST_HEADROOM_ENV, RUNTIME_DIR_ENV
from snugkv.memory.vmm import GIB, MIB

SCENARIOS = ("all-but", "grow", "start")
OUTCOMES = ("complete", "5xx", "4xx", "truncated", "client-error")
SIZED = re.compile(r"Post-capture KV sizing: max_total_num_tokens=(\d+)")
BACK_SHARE = 0.99  # "back": within 1% of the start size
CPU_DEVICE_GIB = 0.5
CPU_HEADROOM_MIB = 24


# -- the other process -----------------------------------------------------------------------
class CoTenant:
    """`pressure_hog` in its own process: `ask` sends one command and returns its JSON answer."""

    def __init__(self, device: str, env: dict[str, str]) -> None:
        command = [sys.executable, "-m", "snugkv.bench.pressure_hog", "--device", device]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the other process exited with {self.process.wait()}")
        return dict(json.loads(line))

    def ask(self, command: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._read()

    def exit(self) -> None:
        """Close its stdin (it frees what it holds) and wait for it to exit."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# -- the load ----------------------------------------------------------------------------------
@dataclass
class Load:
    """Closed-loop streamed completions: each client sends its next request when one ends."""

    url: str
    model: str
    output_tokens: int
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    streaming: int = 0  # streams that got their first chunk and have not ended yet
    errors: list[str] = field(default_factory=list)  # the first few, for the report
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def _note(self, outcome: str, detail: str = "") -> None:
        self.outcomes[outcome] += 1
        if detail and len(self.errors) < 8:
            self.errors.append(f"{outcome}: {detail[:300]}")

    async def client(self, client: httpx.AsyncClient, prompt_tokens: int, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            prompt = [rng.randrange(100, 5000) for _ in range(prompt_tokens)]  # no prefix hits
            body = {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": self.output_tokens,
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            await self._one(client, body)

    async def _one(self, client: httpx.AsyncClient, body: dict[str, Any]) -> None:
        reason, tokens, got_first = None, None, False
        began = time.monotonic()
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    self._note(
                        "5xx" if response.status_code >= 500 else "4xx", f"{response.status_code} {text}"
                    )
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("error"):
                        self._note("5xx", json.dumps(chunk["error"]))
                        return
                    for choice in chunk.get("choices") or []:
                        if not got_first:  # a first chunk (its text may be empty: a server
                            got_first = True  # without a tokenizer, a partial character)
                            self.streaming += 1
                        reason = choice.get("finish_reason") or reason
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
        except httpx.HTTPError as exc:  # where it broke: before the first chunk or inside the stream
            at = "after the first chunk" if got_first else "before any chunk"
            self._note("client-error", f"{exc!r} {at}, {time.monotonic() - began:.1f} s into the request")
            return
        finally:
            self.streaming -= got_first
        if reason == "length" and tokens == body["max_tokens"]:
            self._note("complete")
        else:
            self._note("truncated", f"finish_reason={reason!r}, completion_tokens={tokens!r}")


@dataclass
class Samples:
    """`GET /kv` every `every_s`: (seconds, tokens, committed bytes, device free bytes)."""

    url: str
    every_s: float = 0.1
    rows: list[tuple[float, int, int, int]] = field(default_factory=list)

    async def run(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with _quiet():
                kv = (await client.get("/kv", timeout=10)).json()
                self.rows.append(
                    (
                        time.monotonic(),
                        kv["max_total_num_tokens"],
                        kv["committed_bytes"],
                        kv["device_free_bytes"],
                    )
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.every_s)

    def between(self, start: float, end: float) -> list[tuple[float, int, int, int]]:
        return [row for row in self.rows if start <= row[0] <= end]


def _quiet() -> contextlib.suppress:
    """A failed sample is skipped (the server is busy or stopping), not fatal."""
    return contextlib.suppress(httpx.HTTPError, KeyError, ValueError)


# -- one scenario ------------------------------------------------------------------------------
async def _kv(client: httpx.AsyncClient) -> dict[str, Any]:
    return dict((await client.get("/kv", timeout=30)).json())


async def _wait_back(client: httpx.AsyncClient, tokens: int, timeout_s: float) -> float | None:
    """Seconds until the KV cache holds `BACK_SHARE` of `tokens` again, None if not within the time."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        with _quiet():
            if (await _kv(client))["max_total_num_tokens"] >= BACK_SHARE * tokens:
                return time.monotonic() - started
        await asyncio.sleep(0.05)
    return None


async def _hold(client: httpx.AsyncClient, hold_s: float, seen: set[str], limit_s: float = 60.0) -> None:
    """Hold the memory `hold_s`, and on until the engine has answered it with a pressure move (at
    most `limit_s` more): on a loaded machine a step, and with it the pressure check, can take
    longer than the hold, and a hold that ends first measures nothing."""
    await asyncio.sleep(hold_s)
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        with _quiet():
            events = (await _kv(client))["events"]
            if any(e["reason"] == "pressure" and json.dumps(e, sort_keys=True) not in seen for e in events):
                return
        await asyncio.sleep(0.1)


async def _scenario(
    name: str, url: str, args: argparse.Namespace, env: dict[str, str], start_tokens: int | None = None,
    tenant: CoTenant | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run the load and the other process's part of `name`; `tenant` is one already holding
    memory (the start scenario's), `start_tokens` the size to come back to (default: now)."""
    tenant_given = tenant is not None
    limits = client_limits(args.long + args.short + 8)
    _progress(f"scenario {name}: the load starts")
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        before = await _kv(client)
        start_tokens = start_tokens or before["max_total_num_tokens"]
        # the start scenario's moves began before the load (between the sizing and the first request)
        seen_events = (
            set() if tenant is not None else {json.dumps(e, sort_keys=True) for e in before["events"]}
        )
        load = Load(url, model, args.output_tokens)
        samples = Samples(url)
        sampling = asyncio.Event()
        sampler = asyncio.create_task(samples.run(client, sampling))
        clients = [
            asyncio.create_task(load.client(client, tokens, seed))
            for seed, tokens in enumerate([args.long_tokens] * args.long + [args.short_tokens] * args.short)
        ]
        began = time.monotonic()
        while load.streaming < min(args.long + args.short, 32) and time.monotonic() - began < 60:
            await asyncio.sleep(0.05)  # streams in flight before the other process moves
        in_flight = load.streaming
        taking = time.monotonic()
        answers: list[dict[str, Any]] = []
        context_bytes: int | None = None
        if tenant is None:
            try:
                free_before = (await _kv(client))["device_free_bytes"]
                tenant = CoTenant(args.hog_device, env)
                # what its CUDA context took (its own reading after creating it; load meanwhile aside)
                context_bytes = free_before - int(tenant.ready["free_bytes"])
            except RuntimeError:  # e.g. no room left for its CUDA context: the load stops first
                load.stop.set()
                await asyncio.gather(*clients)
                sampling.set()
                await sampler
                raise
            if name == "grow":
                step = int(args.step_mib * MIB)
                answers.append(
                    await asyncio.to_thread(
                        tenant.ask, f"grow {step} {args.every_ms} {int(args.grow_gib * GIB)}"
                    )
                )
                await _hold(client, args.grow_hold_s, seen_events)
            else:
                answers.append(await asyncio.to_thread(tenant.ask, f"all-but {int(args.leave_mib * MIB)}"))
                await _hold(client, args.hold_s, seen_events)
        else:
            await asyncio.sleep(args.hold_s)
        held_end = time.monotonic()
        await asyncio.to_thread(tenant.exit)
        back_s = await _wait_back(client, start_tokens, args.back_timeout_s)
        held_end = time.monotonic()  # the lowest is looked for until the cache is back
        load.stop.set()  # each client ends after its request in flight
        await asyncio.gather(*clients)
        sampling.set()
        await sampler
        after = await _kv(client)
    during = samples.between(taking, held_end) or [
        (0.0, before["max_total_num_tokens"], before["committed_bytes"], 0)
    ]
    moves = [event for event in after["events"] if json.dumps(event, sort_keys=True) not in seen_events]
    # every move is an event, so the lowest is also looked for in them (a sample may fall between
    # a shrink and the next grow); the start scenario's cache was already moving at `before`
    lowest_tokens = min([row[1] for row in during] + [event["to_tokens"] for event in moves])
    lowest_committed = min([row[2] for row in during] + [event["to_committed_bytes"] for event in moves])
    start_committed = (
        moves[0]["from_committed_bytes"] if tenant_given and moves else before["committed_bytes"]
    )
    headroom = int(after["headroom_bytes"])
    shrinks = [event for event in moves if event["reason"] == "pressure"]
    # what each pressure shrink needed (the headroom less the free memory it measured) and released
    needed = [max(headroom - (event["free_bytes"] or 0), 1) for event in shrinks]
    released = [event["from_committed_bytes"] - event["to_committed_bytes"] for event in shrinks]
    held = max((answer["held_bytes"] for answer in answers), default=0)
    return {
        "scenario": name,
        **load.outcomes,
        "in_flight_when_taken": in_flight,
        "kv_tokens_start": start_tokens,
        "kv_tokens_min": lowest_tokens,
        "kv_tokens_after": after["max_total_num_tokens"],
        "committed_gib_start": round(start_committed / GIB, 3),
        "committed_gib_min": round(lowest_committed / GIB, 3),
        "committed_gib_after": round(after["committed_bytes"] / GIB, 3),
        "guest_room_mib": round(before.get("guest_room_bytes", 0) / MIB),
        "driver_free_mib_start": round(before["device_free_bytes"] / MIB),
        "tenant_context_mib": None if context_bytes is None else round(context_bytes / MIB),
        "taken_gib": round(held / GIB, 3) if answers else None,
        "taken_failed_allocations": sum(answer["failed_allocations"] for answer in answers),
        "take_ms": answers[0]["ms"] if answers else None,
        "moves": len(moves),
        "shrinks": len(shrinks),
        "max_move_ms": round(max((event["took_ms"] for event in moves), default=0.0), 1),
        # the longest wait for the step in flight before a shrink (not part of the move's ms)
        "max_wait_ms": round(max((event.get("waited_ms", 0.0) for event in moves), default=0.0), 1),
        "needed_gib": round(sum(needed) / GIB, 3),
        "released_gib": round(sum(released) / GIB, 3),
        "min_released_over_needed": round(min(r / n for r, n in zip(released, needed, strict=True)), 3)
        if shrinks
        else None,
        "max_over_release_mib": round(max(r - n for r, n in zip(released, needed, strict=True)) / MIB, 1)
        if shrinks
        else None,
        "back_s": None if back_s is None else round(back_s, 2),
        "_moves": moves,
        "_errors": load.errors,
    }


# -- the server --------------------------------------------------------------------------------
def _server_command(args: argparse.Namespace, port: int) -> list[str]:
    command = [sys.executable, "-m", "snugkv", "--log-level", "INFO", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--device", args.device]
    if args.model:
        from snugkv.bench.model_configs import benchmark_model

        command += ["--model", benchmark_model(args.model), "--load-format", "dummy"]
    if args.device == "cpu":
        command += ["--host-kv-gib", str(args.cpu_device_gib), "--kv-chunk-mib", "1"]
    return command + args.serve_args.split()


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def sized_tokens(self) -> int | None:
        match = SIZED.search(self.log())
        return int(match.group(1)) if match else None


def _start(args: argparse.Namespace, env: dict[str, str], log_path: Path, log: IO[bytes]) -> Server:
    port = free_port()
    process = subprocess.Popen(_server_command(args, port), env=env, stdout=log, stderr=subprocess.STDOUT)
    return Server(process, f"http://127.0.0.1:{port}", log_path)


def _progress(message: str) -> None:
    """One line to stderr as the run goes (a run cut by a timeout still shows how far it got)."""
    print(f"[bench pressure {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _wait(server: Server, until: Any, what: str, timeout_s: float = 600.0) -> Any:
    started = time.monotonic()
    deadline = started + timeout_s
    while time.monotonic() < deadline:
        value = until()
        if value:
            _progress(f"the server reached {what} in {time.monotonic() - started:.1f} s")
            return value
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited with {server.process.returncode} before {what}")
        time.sleep(0.02)
    raise RuntimeError(f"the server did not reach {what} in {timeout_s:.0f} s")


def _healthy(server: Server) -> bool:
    try:
        return httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _run_all(
    args: argparse.Namespace, env: dict[str, str], runtime: Path
) -> tuple[list[dict[str, Any]], str]:
    rows: list[dict[str, Any]] = []
    logs = ""
    steady = [name for name in args.scenarios if name != "start"]
    if steady:
        log_path = runtime / "server.log"
        with open(log_path, "wb") as log:
            server = _start(args, env, log_path, log)
            try:
                _wait(server, lambda: _healthy(server), "healthy")
                for name in steady:
                    rows.append(asyncio.run(_scenario(name, server.url, args, env)))
                for row in rows:
                    row["server_alive"] = server.process.poll() is None
            finally:
                stop_server(server.process)
                logs += server.log()
    if "start" in args.scenarios:
        log_path = runtime / "server-start.log"
        with open(log_path, "wb") as log:
            server = _start(args, env, log_path, log)
            try:
                tokens = _wait(server, server.sized_tokens, "its KV sizing")
                tenant = CoTenant(args.hog_device, env)  # its CUDA context first, then it takes
                taken = tenant.ask(f"all-but {int(args.leave_mib * MIB)}")
                _wait(server, lambda: _healthy(server), "healthy")
                row = asyncio.run(
                    _scenario("start", server.url, args, env, start_tokens=tokens, tenant=tenant)
                )
                row.update(
                    taken_gib=round(taken["held_bytes"] / GIB, 3),
                    taken_failed_allocations=taken["failed_allocations"],
                    take_ms=taken["ms"],
                    server_alive=server.process.poll() is None,
                )
                rows.append(row)
            finally:
                stop_server(server.process)
                logs += server.log()
    return rows, logs


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    unknown = [name for name in args.scenarios if name not in SCENARIOS]
    if unknown:
        print(f"error: unknown scenario {unknown[0]!r}; pick from {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.hog_device = "cuda" if args.device.startswith("cuda") else "cpu"
    if args.model is None and args.hog_device == "cuda":
        args.model = "llama-3-8b"
    with tempfile.TemporaryDirectory(prefix="snugkv-pressure-") as directory:
        runtime = Path(args.out) if args.out else Path(directory)  # a cut run keeps the server logs
        runtime.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "TQDM_DISABLE": "1"}
        env.pop("SNUGKV_API_KEY", None)
        if args.hog_device == "cpu":  # one simulated device the server and the co-tenant share
            env[HOST_DEVICE_ENV] = str(args.cpu_device_gib)
            env.setdefault(HOST_HEADROOM_ENV, str(CPU_HEADROOM_MIB))
            env[RUNTIME_DIR_ENV] = str(Path(directory) / "run")
        try:
            rows, logs = _run_all(args, env, runtime)
        except Exception:
            for log in sorted(runtime.glob("server*.log")):
                print(f"{log.name} ends:\n{log.read_text(errors='replace')[-4000:]}", file=sys.stderr)
            raise
    details = [{key: row.pop(key) for key in ("_moves", "_errors")} for row in rows]
    extra = {
        "workload": {
            "long": [args.long, args.long_tokens],
            "short": [args.short, args.short_tokens],
            "output_tokens": args.output_tokens,
        },
        "moves": {row["scenario"]: detail["_moves"] for row, detail in zip(rows, details, strict=True)},
        "errors": {row["scenario"]: detail["_errors"] for row, detail in zip(rows, details, strict=True)},
        "server_log_tracebacks": logs.count("Traceback"),
        "server_log_pressure_lines": [line for line in logs.splitlines() if "pressure" in line.lower()][-40:],
    }
    emit("pressure", rows, args.out, extra=extra)
    for row, detail in zip(rows, details, strict=True):
        if detail["_moves"]:
            print(f"\n{row['scenario']}: the KV cache's moves")
            columns = (
                "reason",
                "from_tokens",
                "to_tokens",
                "from_committed_bytes",
                "to_committed_bytes",
                "took_ms",
                "waited_ms",
            )
            print(format_table([{key: move.get(key) for key in columns} for move in detail["_moves"]]))
        for error in detail["_errors"]:
            print(f"{row['scenario']}: {error}")
    failed = any(
        row["5xx"] or row["truncated"] or row["client-error"] or not row.get("server_alive", True)
        for row in rows
    )
    return 1 if failed else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenarios", type=lambda text: text.split(","), default=list(SCENARIOS),
                        help=f"comma-separated, of {', '.join(SCENARIOS)} (default: all)")  # fmt: skip
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--model", default=None, help="a shipped shape or model directory, random weights "
                        "(default on a GPU: llama-3-8b; on a CPU: the embedded SmolLM2, its real weights)")  # fmt: skip
    parser.add_argument("--serve-args", default="", help="more `snugkv serve` flags (default: none)")
    parser.add_argument("--long", type=int, default=64, help="clients with long prompts (default: 64)")
    parser.add_argument("--long-tokens", type=int, default=4096, help="(default: 4096)")
    parser.add_argument("--short", type=int, default=64, help="clients with short prompts (default: 64)")
    parser.add_argument("--short-tokens", type=int, default=64, help="(default: 64)")
    parser.add_argument("--output-tokens", type=int, default=128, help="each request's output (default: 128)")
    parser.add_argument(
        "--leave-mib", type=float, default=64.0, help="all-but and start leave this free (64)"
    )
    parser.add_argument("--hold-s", type=float, default=10.0, help="all-but and start hold this long (10)")
    parser.add_argument("--step-mib", type=float, default=256.0, help="grow's step (default: 256)")
    parser.add_argument("--every-ms", type=float, default=50.0, help="grow's tick (default: 50)")
    parser.add_argument("--grow-gib", type=float, default=40.0, help="grow's limit (default: 40)")
    parser.add_argument("--grow-hold-s", type=float, default=30.0, help="grow holds its limit this long (30)")
    parser.add_argument(
        "--back-timeout-s", type=float, default=30.0, help="the wait for the KV cache to come back"
    )
    parser.add_argument("--cpu-device-gib", type=float, default=CPU_DEVICE_GIB,
                        help=f"on a CPU: the simulated device's size (default: {CPU_DEVICE_GIB})")  # fmt: skip
