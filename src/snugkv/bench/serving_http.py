"""The offline serving workload through the real HTTP server and a real client.

`snugkv serve` runs as its own process (random weights of a shipped config); an `httpx` async
client sends every request at once to `/v1/completions` (prompt token ids, `ignore_eos`, streamed
as server-sent events so the first token's arrival is seen) and the figures are taken from what the
client receives: output tokens per second over the wall time, time to first token. The client
encodes the request bodies and opens its connections before the clock starts. The server's own
`/server_info` gives the KV size it sized, and the GPU-idle share of the run from its scheduler's
device-busy seconds (CUDA events around each step). Where /proc exists, the CPU seconds of the
server's event-loop thread and of its other threads (the scheduler's) over the run ride along: the
two share one GIL, so their sum against the wall time says how much of it the run needed. The
server's last steps one by one (`/server_info?steps=true`) place the GPU's idle time: before the
first step of the pass (requests still arriving) or between steps (the host late).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from typing import IO, Any

import httpx

from snugkv.bench.harness import client_limits, percentile_ms
from snugkv.bench.idle import gc_figures, step_figures
from snugkv.distributed.launch import free_port


def serve_command(model: str, extra: list[str]) -> list[str]:
    """`snugkv serve` of `model` with random weights; the port is added by `start_server`."""
    return [
        sys.executable, "-m", "snugkv", "--log-level", "WARNING", "serve", "--model", model,
        "--load-format", "dummy", "--host", "127.0.0.1", *extra,
    ]  # fmt: skip


def start_server(
    command: list[str],
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    log: IO[bytes] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """`command --port P` on a free loopback port (in `env`, default this process's environment;
    its output to `log`, default this process's); returns the process and its base URL once healthy."""
    port = free_port()
    command = [*command, "--port", str(port)]
    process = subprocess.Popen(
        command,
        env={**(os.environ if env is None else env), "TQDM_DISABLE": "1"},
        stdout=log,
        stderr=None if log is None else subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"snugkv serve exited with code {process.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    process.terminate()
    raise RuntimeError(f"snugkv serve was not healthy after {timeout_s:.0f} s")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


async def _drive(url: str, requests: list[tuple[list[int], int]], stream: bool = True) -> dict[str, Any]:
    limits = client_limits(len(requests) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=3600.0, limits=limits) as client:
        served = (await client.get("/v1/models")).json()["data"][0]["id"]
        bodies = [_body(served, prompt, max_tokens, stream) for prompt, max_tokens in requests]
        # A load generator's pool is warm: its connections are open before the clock starts (as
        # a proxy's or a harness's kept-alive ones are), so the pass times requests, not handshakes.
        await asyncio.gather(*(client.get("/health") for _ in requests))
        headers = {"content-type": "application/json"}
        started = time.monotonic()

        async def one(body: bytes) -> tuple[int, float | None]:
            if not stream:
                response = await client.post("/v1/completions", content=body, headers=headers)
                response.raise_for_status()
                return response.json()["usage"]["completion_tokens"], None
            first: float | None = None
            tail = b""
            async with client.stream("POST", "/v1/completions", content=body, headers=headers) as response:
                response.raise_for_status()
                # The client reads bytes, not events: parsing every chunk would make it, not the
                # server, what a busy machine measures. The first text and the usage are enough.
                async for piece in response.aiter_bytes():
                    if first is None and _TEXT.search(piece):
                        first = time.monotonic()
                    tail = (tail + piece)[-_TAIL_BYTES:]
            return _completion_tokens(tail), None if first is None else first - started

        results = await asyncio.gather(*(one(body) for body in bodies))
        elapsed = time.monotonic() - started
    tokens = sum(count for count, _ in results)
    ttft = [first for _, first in results if first is not None]
    return {
        "requests": len(requests),
        "output_tokens": tokens,
        "seconds": elapsed,
        "output_tok_per_s": tokens / elapsed,
        "span": (started, started + elapsed),  # the pass on the monotonic clock the server's steps use
        # a model without tokenizer files streams no text, so no first-token time is seen (nor
        # without streaming)
        "ttft_p50_ms": percentile_ms(ttft, 0.5) if len(ttft) == len(results) else None,
    }


def _body(model: str, prompt: list[int], max_tokens: int, stream: bool) -> bytes:
    """One request's JSON, encoded before the clock starts (the client's work, not the server's)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": stream,
        "ignore_eos": True,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


_TEXT = re.compile(rb'"text":"[^"]')  # a chunk with text in it
_TAIL_BYTES = 16384


def _completion_tokens(tail: bytes) -> int:
    """`completion_tokens` of the usage chunk at the end of a stream (an error if there is none)."""
    for event in reversed(tail.split(b"\n\n")):
        if event.startswith(b"data: {") and b'"usage":{' in event:
            return int(json.loads(event[len(b"data: ") :])["usage"]["completion_tokens"])
    raise RuntimeError(f"the stream ended without usage: ...{tail[-300:].decode(errors='replace')}")


def run_http(model: str, requests: list[tuple[list[int], int]], extra: list[str]) -> dict[str, Any]:
    """The workload through a fresh `snugkv serve`, streamed; its KV size and scheduler figures ride along."""
    return run_on_server(serve_command(model, extra), requests, (True,))[0]


def run_on_server(
    command: list[str],
    requests: list[tuple[list[int], int]],
    streams: tuple[bool, ...],
    *,
    first_pass: bool = False,
) -> list[dict[str, Any]]:
    """The workload through one fresh server started by `command`, once per entry of `streams`
    (streamed or not). A pass after the first changes each prompt's first token, so the prefix
    cache holds nothing of it (the lengths, and so the work, stay the same). `first_pass`: the
    whole workload runs once (streamed) before them, as the in-process runs get it; its result
    comes first."""
    process, url = start_server(command)
    try:
        warm_up = [([4 + i, *range(10, 70)], 64) for i in range(16)]  # compiles, allocations
        asyncio.run(_drive(url, warm_up, True))
        results = []
        if first_pass:  # meets every kernel and shape of the load once (Triton compiles, allocations)
            results.append(_measured(url, process.pid, [([8, *p[1:]], out) for p, out in requests], True))
        for index, stream in enumerate(streams):
            load = requests if index == 0 else [([3 + index % 5, *p[1:]], out) for p, out in requests]
            results.append(_measured(url, process.pid, load, stream))
        return results
    finally:
        stop_server(process)


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process `pid`; empty where /proc is missing."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    times: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return times
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        times[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return times


def _measured(url: str, pid: int, requests: list[tuple[list[int], int]], stream: bool) -> dict[str, Any]:
    before_info = httpx.get(f"{url}/server_info", timeout=10.0).json()
    before = before_info.get("step_times", {})
    engine_pid = (before_info.get("engine_process") or {}).get("pid")  # --engine-process: the scheduler's
    engine_before = thread_cpu_s(engine_pid) if engine_pid else {}
    cpu_before, client_before = thread_cpu_s(pid), time.process_time()
    result = asyncio.run(_drive(url, requests, stream))
    cpu_after = thread_cpu_s(pid)
    result["client_cpu_s"] = time.process_time() - client_before  # a client that needs a core of its own
    if cpu_after:  # the event loop runs on the main thread (tid == pid); the scheduler on another
        spent = {tid: cpu - cpu_before.get(tid, 0.0) for tid, cpu in cpu_after.items()}
        result["loop_cpu_s"] = spent.pop(pid, 0.0)
        result["other_threads_cpu_s"] = sum(spent.values())
    if engine_pid:
        engine_after = thread_cpu_s(engine_pid)
        result["engine_process_cpu_s"] = sum(
            cpu - engine_before.get(tid, 0.0) for tid, cpu in engine_after.items()
        )
    info = httpx.get(f"{url}/server_info", params={"steps": "true"}, timeout=10.0).json()
    result["max_total_num_tokens"] = info.get("max_total_num_tokens")
    start, end = result.pop("span")
    result.update(step_figures(info.get("recent_steps", []), start, end))
    if "gc" in info and "gc" in before_info:
        result.update(gc_figures(before_info["gc"], info["gc"]))
    after = info.get("step_times", {})
    if "device_busy_s" in after:  # the share of the run the GPU waited for the host
        busy = after["device_busy_s"] - before.get("device_busy_s", 0.0)
        result["gpu_idle_fraction"] = max(0.0, 1 - busy / result["seconds"])
    return result
