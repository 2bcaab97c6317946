"""Two `snugkv serve --kv-elastic` engines on one GPU: a Qwen3-0.6B-shaped and a Llama-3-8B-shaped
server (random weights, `--load-format dummy`), started in either order, each under load.

    python scripts/bench_multi_engine.py --out docs/bench/multi-engine [--load-s 12] [--skip-alone]

For each order (small first, large first):
1. the first engine starts alone and its KV cache is read (what one engine alone sizes to);
2. it serves a steady load (concurrent clients, random token prompts, `ignore_eos`);
3. the second starts while it serves: the time until the second has its memory (the ask granted,
   from its log) and until it serves are measured; then both serve a load for `--load-s`;
4. every request must succeed and neither server may log an out-of-memory error or die.
Figures: the sum of both KV caches against what one post-capture engine alone would have left for
KV after both models' weights and graphs (the first engine's KV alone, less the second's weights,
graphs and buffers from its ledger); each engine's output tokens/s sharing the GPU, and (unless
`--skip-alone`) alone on the GPU at the same KV size (`--max-total-tokens` of what it held).
Then (`--phases together`) two replicas of the Llama-3-8B shape start at the same moment: each one's
start-up KV size (its sizing line, before any rebalance) against the even split, the commit retries
its log shows, and both serving a load.
Everything goes to `OUT/multi_engine.json`; a summary is printed. About 5 minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "src" / "snugkv" / "bench" / "configs"
MODELS = {"small": CONFIGS / "qwen3-0.6b", "large": CONFIGS / "llama-3-8b"}
GIB = 1 << 30
GRANTED = re.compile(r"Memory share: ([\d.]+) GiB asked and free after ([\d.]+) s")
OOM = re.compile(r"out of memory|CUDA error|Traceback", re.IGNORECASE)
SIZED = re.compile(r"Post-capture KV sizing: max_total_num_tokens=(\d+)")
RETRY = "retrying with fewer tokens"
PHASES = ("orders", "alone", "together")


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    started_at: float
    serving_after_s: float = 0.0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str) -> dict[str, Any]:
        return httpx.get(f"{self.url}{path}", timeout=60).json()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start(name: str, out: Path, env: dict[str, str], extra: list[str], model: str = "") -> Server:
    """`name` is the served model name; `model` the shape (default: the shape named `name`)."""
    port = free_port()
    log_path = out / f"{name}-{int(time.time())}.log"
    command = [
        sys.executable, "-m", "snugkv", "serve", "--model", str(MODELS[model or name]), "--load-format", "dummy",
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name, *extra,
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    return Server(name, process, f"http://127.0.0.1:{port}", log_path, time.monotonic())


def wait_healthy(server: Server, timeout_s: float = 240.0) -> Server:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"{server.name} exited with {server.process.returncode}:\n{server.log()[-4000:]}"
            )
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                server.serving_after_s = time.monotonic() - server.started_at
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{server.name} was not healthy after {timeout_s} s:\n{server.log()[-4000:]}")


def stop(server: Server) -> int:
    server.process.terminate()
    try:
        return server.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.process.kill()
        return server.process.wait()


@dataclass
class Load:
    """`clients` threads sending completions of random token prompts until stopped."""

    server: Server
    clients: int = 16
    prompt_tokens: tuple[int, int] = (128, 1024)
    output_tokens: int = 128
    tokens: int = 0
    requests: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    window: tuple[float, int] = (0.0, 0)

    def start(self) -> Load:
        for index in range(self.clients):
            thread = threading.Thread(target=self._client, args=(index,), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def _client(self, index: int) -> None:
        rng = random.Random(index)
        with httpx.Client(timeout=600) as client:
            while not self.stop.is_set():
                prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(*self.prompt_tokens))]
                body = {
                    "model": self.server.name,
                    "prompt": prompt,
                    "max_tokens": self.output_tokens,
                    "ignore_eos": True,
                }
                try:
                    response = client.post(f"{self.server.url}/v1/completions", json=body)
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                    continue
                if response.status_code != 200:
                    self.failures.append(f"{response.status_code}: {response.text[:300]}")
                    continue
                self.tokens += response.json()["usage"]["completion_tokens"]
                self.requests += 1

    def mark(self) -> None:
        self.window = (time.monotonic(), self.tokens)

    def tokens_per_s(self) -> float:
        started, tokens = self.window
        return (self.tokens - tokens) / max(time.monotonic() - started, 1e-9)

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=900)


def kv_of(server: Server) -> dict[str, Any]:
    kv = server.get("/kv")
    return {"tokens": kv["max_total_num_tokens"], "bytes": kv["committed_bytes"]}


def ledger_of(server: Server) -> dict[str, Any]:
    return server.get("/server_info")["memory_ledger"]


def check_clean(server: Server) -> list[str]:
    problems = [f"{server.name}: {line}" for line in server.log().splitlines() if OOM.search(line)]
    if server.process.poll() is not None:
        problems.append(f"{server.name} exited with {server.process.returncode}")
    return problems


def run_order(first: str, second: str, out: Path, env: dict[str, str], load_s: float) -> dict[str, Any]:
    elastic = ["--kv-elastic"]
    a = wait_healthy(start(first, out, env, elastic))
    alone_kv = kv_of(a)
    alone_ledger = ledger_of(a)
    load_a = Load(a).start()
    time.sleep(min(load_s / 2, 5))
    b = start(second, out, env, elastic)
    granted_s = None
    deadline = time.monotonic() + 240
    while granted_s is None and time.monotonic() < deadline:
        match = GRANTED.search(b.log())
        if match:
            granted_s = float(match.group(2))
        elif b.process.poll() is not None:
            break
        time.sleep(0.2)
    wait_healthy(b)
    load_b = Load(b).start()
    time.sleep(3)  # the rebalance after the start settles (hysteresis, 2 s interval)
    load_a.mark()
    load_b.mark()
    time.sleep(load_s)
    shared = {first: load_a.tokens_per_s(), second: load_b.tokens_per_s()}
    kv = {first: kv_of(a), second: kv_of(b)}
    engines = a.get("/kv/engines")
    ledger_b = ledger_of(b)
    load_a.finish()
    load_b.finish()
    problems = check_clean(a) + check_clean(b) + load_a.failures + load_b.failures
    second_static = ledger_b["weights_bytes"] + ledger_b["graphs_and_buffers_bytes"]
    second_static += ledger_b["graph_executables_bytes"]
    one_engine_kv = alone_kv["bytes"] - second_static
    total = kv[first]["bytes"] + kv[second]["bytes"]
    result = {
        "order": f"{first} first",
        "first_alone_kv": alone_kv,
        "first_alone_ledger": alone_ledger,
        "second_ledger": ledger_b,
        "kv_shared": kv,
        "kv_sum_bytes": total,
        "one_engine_kv_after_both_weights_and_graphs_bytes": one_engine_kv,
        "kv_sum_gap_gib": (one_engine_kv - total) / GIB,
        "second_granted_memory_after_s": granted_s,
        "second_serving_after_s": b.serving_after_s,
        "tokens_per_s_shared": shared,
        "requests": {first: load_a.requests, second: load_b.requests},
        "engines": engines,
        "problems": problems,
    }
    stop(b)
    stop(a)
    return result


def run_alone(name: str, tokens: int, out: Path, env: dict[str, str], load_s: float) -> dict[str, Any]:
    server = wait_healthy(start(name, out, env, ["--max-total-tokens", str(tokens)]))
    load = Load(server).start()
    time.sleep(3)
    load.mark()
    time.sleep(load_s)
    rate = load.tokens_per_s()
    load.finish()
    problems = check_clean(server) + load.failures
    stop(server)
    return {"kv_tokens": tokens, "tokens_per_s": rate, "problems": problems}


def run_together(out: Path, env: dict[str, str], load_s: float) -> dict[str, Any]:
    """Two `--kv-elastic` replicas of the 8B shape started at once (issue 36 item 7)."""
    pair = [start(name, out, env, ["--kv-elastic"], model="large") for name in ("large-a", "large-b")]
    try:
        return _serve_together(pair, load_s)
    finally:  # a server that failed to start is stopped too
        for server in pair:
            stop(server)


def _serve_together(pair: list[Server], load_s: float) -> dict[str, Any]:
    for server in pair:
        wait_healthy(server)
    sized = []
    for server in pair:
        match = SIZED.search(server.log())
        sized.append(int(match.group(1)) if match else None)
    loads = [Load(server).start() for server in pair]
    time.sleep(3)
    for load in loads:
        load.mark()
    time.sleep(load_s)
    rates = [load.tokens_per_s() for load in loads]
    kv = [kv_of(server) for server in pair]
    for load in loads:
        load.finish()
    problems = [problem for server in pair for problem in check_clean(server)]
    problems += [failure for load in loads for failure in load.failures]
    known = [tokens for tokens in sized if tokens is not None]
    mean = sum(known) / len(known) if known else 0.0
    result = {
        "sized_tokens": sized,  # each one's sizing line, before any rebalance
        "max_off_even": max(abs(tokens - mean) / mean for tokens in known) if known else None,
        "commit_retries": [server.log().count(RETRY) for server in pair],
        "serving_after_s": [server.serving_after_s for server in pair],
        "kv_after_load": kv,
        "tokens_per_s": rates,
        "problems": problems,
    }
    return result


def _percent(fraction: float | None) -> str:
    return "unknown (no sizing line)" if fraction is None else f"{fraction:.1%}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, type=Path, help="directory for multi_engine.json and logs")
    parser.add_argument("--load-s", type=float, default=12.0, help="seconds of measured load per phase")
    parser.add_argument("--skip-alone", action="store_true", help="skip the alone-at-the-same-KV baselines")
    parser.add_argument(
        "--phases", default=",".join(PHASES), help=f"which of {','.join(PHASES)} to run (comma-separated)"
    )
    args = parser.parse_args()
    phases = set(args.phases.split(","))
    if args.skip_alone:
        phases.discard("alone")
    if phases - set(PHASES):
        parser.error(f"--phases: unknown {sorted(phases - set(PHASES))}; choose from {','.join(PHASES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO / "src"))
    from snugkv.bench.harness import environment

    env = {**os.environ, "TQDM_DISABLE": "1", "SNUGKV_RUNTIME_DIR": tempfile.mkdtemp(prefix="snugkv-me-")}
    env.pop("SNUGKV_API_KEY", None)
    results: dict[str, Any] = {"environment": environment(), "orders": []}
    for first, second in (("small", "large"), ("large", "small")) if "orders" in phases else ():
        results["orders"].append(run_order(first, second, args.out, env, args.load_s))
    if "alone" in phases and results["orders"]:
        shared = results["orders"][0]["kv_shared"]
        results["alone_at_same_kv"] = {
            name: run_alone(name, shared[name]["tokens"], args.out, env, args.load_s)
            for name in ("small", "large")
        }
    failed = False
    for order in results["orders"]:
        kv = order["kv_shared"]
        print(
            f"{order['order']}: KV small {kv['small']['bytes'] / GIB:.2f} + large {kv['large']['bytes'] / GIB:.2f} = "
            f"{order['kv_sum_bytes'] / GIB:.2f} GiB vs one engine after both weights and graphs "
            f"{order['one_engine_kv_after_both_weights_and_graphs_bytes'] / GIB:.2f} GiB "
            f"(gap {order['kv_sum_gap_gib']:.2f} GiB); second got its memory after "
            f"{order['second_granted_memory_after_s']} s, served after {order['second_serving_after_s']:.1f} s; "
            f"tokens/s shared: small {order['tokens_per_s_shared']['small']:.0f}, "
            f"large {order['tokens_per_s_shared']['large']:.0f}"
        )
        for problem in order["problems"][:10]:
            print(f"  PROBLEM: {problem}")
        failed |= bool(order["problems"])
    for name, alone in results.get("alone_at_same_kv", {}).items():
        print(
            f"alone at the same KV ({alone['kv_tokens']} tokens): {name} {alone['tokens_per_s']:.0f} tokens/s"
        )
        failed |= bool(alone["problems"])
    out_json = args.out / "multi_engine.json"
    out_json.write_text(json.dumps(results, indent=2, default=str))  # the phases so far, if the next fails
    if "together" in phases:
        together = results["together"] = run_together(args.out, env, args.load_s)
        print(
            f"started together: sized {together['sized_tokens']} tokens (max {_percent(together['max_off_even'])} off even), "
            f"commit retries {together['commit_retries']}, serving after "
            f"{', '.join(f'{s:.1f}' for s in together['serving_after_s'])} s; tokens/s "
            f"{', '.join(f'{r:.0f}' for r in together['tokens_per_s'])}"
        )
        for problem in together["problems"][:10]:
            print(f"  PROBLEM: {problem}")
        off = together["max_off_even"]
        failed |= bool(together["problems"]) or off is None or off > 0.10
    (args.out / "multi_engine.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.out / 'multi_engine.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
