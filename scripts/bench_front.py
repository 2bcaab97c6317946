"""What the front of `snugkv serve --dp` costs a stream: many small streamed completions sent four
ways to one stand-in replica, with the same load each time.

    python scripts/bench_front.py [--requests 800] [--concurrency 32] [--events 32] [--event-gap-ms 2]

    stand-in      client -> replica                      (no front, no router)
    front         client -> front -> replica             (a token-id prompt: the front's own route)
    smg           client -> smg -> replica               (a text prompt, smg as `--dp` starts it)
    front+smg     client -> front -> smg -> replica      (a text prompt: the `--dp` path)

The stand-in replica is a small asyncio HTTP server in its own process: it answers smg's probes
and streams each completion as `--events` server-sent events of an OpenAI chunk's shape, one every
`--event-gap-ms` (a fast decode), then `[DONE]`. The front (`snugkv.server.front.Front`) and smg
1.13 run in processes of their own, as under `serve --dp`. The client, in this process, keeps
`--concurrency` raw keep-alive connections and reads every answer to its last chunk. Per way:
requests/s, the time to the first event and to the end (p50, p99), and the CPU time the front and
smg processes spent, per streamed event and per request (from /proc: figures a busy machine
changes less than the wall times). A printed table, and JSON with `--out FILE`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = "stand-in"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# -- the stand-in replica ------------------------------------------------------------------------
def stand_in(port: int, events: int, event_gap_s: float) -> None:
    chunk = json.dumps(
        {
            "id": "cmpl-stand-in",
            "object": "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "text": " token", "logprobs": None, "finish_reason": None}],
        }
    ).encode()
    event = b"data: " + chunk + b"\n\n"
    last = (
        b"data: "
        + chunk.replace(b'"finish_reason": null', b'"finish_reason": "length"')
        + b"\n\ndata: [DONE]\n\n"
    )
    answers = {
        b"/v1/models": json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode(),
        b"/v1/loads": json.dumps(
            {"dp_rank_count": 1, "loads": [{"dp_rank": 0, "num_total_reqs": 0}]}
        ).encode(),
        b"/health": b"{}",
        b"/ready": b"{}",
    }

    def framed(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, target, _ = head.split(b"\r\n", 1)[0].split(b" ")
                lower = head.lower()
                length = (
                    int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
                    if b"content-length:" in lower
                    else 0
                )
                await reader.readexactly(length)
                close = b"connection: close" in lower
                connection = b"connection: close\r\n" if close else b""
                path = target.split(b"?")[0]
                if method == b"POST" and path == b"/v1/completions":
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                        + connection
                        + b"\r\n"
                    )
                    for _ in range(events - 1):
                        writer.write(framed(event))
                        await writer.drain()
                        await asyncio.sleep(event_gap_s)
                    writer.write(framed(last) + b"0\r\n\r\n")
                else:
                    body = answers.get(path, b'{"error": {"message": "not here"}}')
                    status = b"200 OK" if path in answers else b"404 Not Found"
                    writer.write(
                        b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
                        % (status, len(body), connection, body)
                    )
                await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", port, backlog=2048)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# -- the front, alone in its process ----------------------------------------------------------
def front(port: int, router_port: int, replica_port: int) -> None:
    from snugkv.server.front import Front, FrontOptions
    from snugkv.server.sockets import bind_socket

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # for sigwait, in every thread
    running = Front(
        bind_socket("127.0.0.1", port, listen=False),
        FrontOptions(router_port=router_port, replica_ports=(replica_port,)),
    )
    running.start()
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    running.stop_taking_connections()
    running.close()


# -- the client ------------------------------------------------------------------------------------
async def one_pass(port: int, prompt: object, requests: int, concurrency: int) -> dict[str, float]:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 32, "stream": True}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    remaining = requests
    first_s: list[float] = []
    total_s: list[float] = []

    async def worker() -> None:
        nonlocal remaining
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while remaining > 0:
            remaining -= 1
            began = time.perf_counter()
            writer.write(request)
            buffer = bytearray(await reader.readuntil(b"\r\n\r\n"))
            assert buffer.startswith(b"HTTP/1.1 200"), bytes(buffer)
            close = b"connection: close" in buffer.lower()
            buffer.clear()
            first = 0.0
            while not buffer.endswith(b"0\r\n\r\n"):
                data = await reader.read(65536)
                if not data:
                    raise ConnectionError("the server closed the connection mid-answer")
                buffer += data
                first = first or time.perf_counter()
            assert b"[DONE]" in buffer
            first_s.append(first - began)
            total_s.append(time.perf_counter() - began)
            if close:
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall_s = time.perf_counter() - began
    return {
        "requests_per_s": len(total_s) / wall_s,
        "first_event_p50_ms": 1000 * statistics.median(first_s),
        "first_event_p99_ms": 1000 * statistics.quantiles(first_s, n=100)[98],
        "total_p50_ms": 1000 * statistics.median(total_s),
        "total_p99_ms": 1000 * statistics.quantiles(total_s, n=100)[98],
        "wall_s": wall_s,
    }


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(url: str, timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer in {timeout_s:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--events", type=int, default=32)
    parser.add_argument("--event-gap-ms", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2, help="timed passes of each way, interleaved")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--role", choices=["stand-in", "front"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ports", type=int, nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "stand-in":
        stand_in(args.ports[0], args.events, args.event_gap_ms / 1000)
        return 0
    if args.role == "front":
        front(*args.ports)
        return 0

    from snugkv.server.router import RouterOptions, find_router_binary, healthy_workers, router_command

    replica_port, smg_port, front_port = free_port(), free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    me = [sys.executable, __file__, "--events", str(args.events), "--event-gap-ms", str(args.event_gap_ms)]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
    replica = subprocess.Popen([*me, "--role", "stand-in", "--ports", str(replica_port)], **quiet)  # type: ignore[call-overload]
    options = RouterOptions(host="127.0.0.1", port=smg_port, metrics_port=free_port(), log_level="error")
    smg = subprocess.Popen(
        router_command(find_router_binary(), [f"http://127.0.0.1:{replica_port}"], options), **quiet
    )  # type: ignore[call-overload]
    ports = [str(front_port), str(smg_port), str(replica_port)]
    front_process = subprocess.Popen([*me, "--role", "front", "--ports", *ports], **quiet)  # type: ignore[call-overload]
    try:
        wait_for(f"http://127.0.0.1:{replica_port}/ready")
        deadline = time.monotonic() + 60
        while not healthy_workers(f"http://127.0.0.1:{smg_port}"):
            assert time.monotonic() < deadline, "smg did not count the stand-in healthy"
            time.sleep(0.2)
        wait_for(f"http://127.0.0.1:{front_port}/v1/models")
        token_ids, text = [1, 2, 3, 4], "one two three four"
        ways = {
            "stand-in": (replica_port, token_ids),
            "front": (front_port, token_ids),
            "smg": (smg_port, text),
            "front+smg": (front_port, text),
        }
        results: dict[str, list[dict[str, float]]] = {name: [] for name in ways}
        for port, prompt in ways.values():  # warm-up: connections, smg's pools and trees
            asyncio.run(one_pass(port, prompt, args.concurrency * 2, args.concurrency))
        for _ in range(args.rounds):
            for name, (port, prompt) in ways.items():
                before = {"front": cpu_s(front_process.pid), "smg": cpu_s(smg.pid)}
                row = asyncio.run(one_pass(port, prompt, args.requests, args.concurrency))
                for process, pid in (("front", front_process.pid), ("smg", smg.pid)):
                    spent_s = cpu_s(pid) - before[process]
                    row[f"{process}_cpu_us_per_event"] = 1e6 * spent_s / (args.requests * args.events)
                    row[f"{process}_cpu_us_per_request"] = 1e6 * spent_s / args.requests
                results[name].append(row)
                print(name, {key: round(value, 2) for key, value in row.items()}, flush=True)
    finally:
        for process in (front_process, smg, replica):
            process.send_signal(signal.SIGTERM)
        for process in (front_process, smg, replica):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
    best = {name: min(rows, key=lambda row: row["total_p50_ms"]) for name, rows in results.items()}
    header = "| way | req/s | first event p50 / p99 ms | end p50 / p99 ms | front CPU µs/event, µs/request | smg CPU µs/event, µs/request |"
    print(header)
    print("| --- " * 6 + "|")
    for name, row in best.items():
        print(
            f"| {name} | {row['requests_per_s']:.0f} | {row['first_event_p50_ms']:.1f} / {row['first_event_p99_ms']:.1f} "
            f"| {row['total_p50_ms']:.1f} / {row['total_p99_ms']:.1f} "
            f"| {row['front_cpu_us_per_event']:.1f}, {row['front_cpu_us_per_request']:.0f} "
            f"| {row['smg_cpu_us_per_event']:.1f}, {row['smg_cpu_us_per_request']:.0f} |"
        )
    if args.out is not None:
        args.out.write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
