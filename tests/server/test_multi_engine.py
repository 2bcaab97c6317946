"""Two real `snugkv serve --kv-elastic` servers on one simulated device (the host backend with a
budget shared through SNUGKV_HOST_DEVICE_GIB): the second starts while the first streams, neither
loses a request, the first grows back when the second is killed, and its stale entry goes; an
engine that sleeps while the other grows into its memory asks for it back when it wakes. (A
graceful stop leaves the record in `tests/memory_share/test_record.py`.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.server import expect

# End to end (make test-fast leaves it out): several real server processes on one simulated device.
pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
DEVICE_GIB = 0.5
MIN_TOKENS = 2048
SERVING = re.compile(r"snugkv is serving on (http://\S+)")


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    log_path: Path
    url: str = ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kv(self) -> dict:
        return httpx.get(f"{self.url}/kv", timeout=30).json()

    def engines(self) -> dict:
        return httpx.get(f"{self.url}/kv/engines", timeout=30).json()


def start(tmp: Path, name: str, env: dict[str, str]) -> Server:
    log_path = tmp / f"{name}.log"
    command = [
        sys.executable, "-m", "snugkv", "serve", "--device", "cpu", "--port", "0", "--kv-elastic",
        "--host-kv-gib", str(DEVICE_GIB), "--kv-min-tokens", str(MIN_TOKENS), "--kv-chunk-mib", "1",
        "--max-running-requests", "8", "--served-model-name", name,
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return Server(process, log_path)


def wait_serving(server: Server, timeout_s: float = 90.0) -> Server:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = SERVING.search(server.log())
        if match:
            server.url = match.group(1)
            return server
        if server.process.poll() is not None:
            raise AssertionError(f"the server exited with {server.process.returncode}:\n{server.log()}")
        time.sleep(0.1)
    raise AssertionError(f"the server did not start in {timeout_s} s:\n{server.log()}")


def wait_for(what: str, check, server: Server, timeout_s: float = 30.0):  # type: ignore[no-untyped-def]
    return expect.wait_for(check, timeout_s, what, poll_s=0.25, detail=server.log)


@dataclass
class Load:
    """Streamed completions sent one after another (two at a time) until stopped."""

    url: str
    model: str
    prompt: str | list[int] = "Once upon a time"
    finished: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                body = {"model": self.model, "prompt": self.prompt, "max_tokens": 24, "stream": True}
                reason = None
                try:
                    with client.stream("POST", f"{self.url}/v1/completions", json=body) as response:
                        if response.status_code != 200:
                            self.failures.append(f"{response.status_code}: {response.read()!r}")
                            continue
                        for line in response.iter_lines():
                            if line.startswith("data: {"):
                                choice = json.loads(line[6:])["choices"][0]
                                reason = choice.get("finish_reason") or reason
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                    continue
                if reason in ("length", "stop"):
                    self.finished.append(reason)
                else:
                    self.failures.append(f"stream ended with finish_reason {reason!r}")


@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    values = {
        **os.environ,
        "SNUGKV_RUNTIME_DIR": str(tmp_path / "run"),
        "SNUGKV_HOST_DEVICE_GIB": str(DEVICE_GIB),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH")])),
    }
    values.pop("SNUGKV_API_KEY", None)
    return values


@pytest.fixture()
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def test_a_second_engine_starts_beside_a_busy_one_and_the_first_grows_back(
    tmp_path: Path, env: dict[str, str], servers: list[Server]
) -> None:
    first = wait_serving(start(tmp_path, "first", env))
    servers.append(first)
    alone_tokens = first.kv()["max_total_num_tokens"]
    loads = [Load(first.url, "first") for _ in range(2)]
    threads = [threading.Thread(target=load.run) for load in loads]
    for thread in threads:
        thread.start()
    try:
        wait_for("the first streams", lambda: sum(len(load.finished) for load in loads) >= 2, first)

        # The second starts while the first streams: the first gives room before it loads.
        second = wait_serving(start(tmp_path, "second", env))
        servers.append(second)
        assert "asked and free after" in second.log()
        assert "Traceback" not in second.log(), second.log()
        assert first.kv()["max_total_num_tokens"] < alone_tokens
        # its ask is met within the band's floor (32 MiB); the rebalance then gives it its share
        wait_for("the second's share", lambda: second.kv()["max_total_num_tokens"] > MIN_TOKENS, second)
        shown = first.engines()
        assert {e["name"]: e["state"] for e in shown["engines"]} == {"first": "running", "second": "running"}
        assert sum(e["share"] for e in shown["engines"]) == pytest.approx(1.0)
        with httpx.Client(timeout=60) as client:
            answer = client.post(
                f"{second.url}/v1/completions", json={"model": "second", "prompt": "Hello", "max_tokens": 8}
            )
        assert answer.status_code == 200, answer.text

        # Killed with SIGKILL: its stale entry is cleared (its simulated device memory too, as a
        # driver frees a dead process's memory) and the first grows back into what it held.
        second.process.kill()
        second.process.wait()
        wait_for(
            "the first to grow back", lambda: first.kv()["max_total_num_tokens"] >= alone_tokens * 0.9, first
        )
        assert f"Cleared the stale entry of engine pid {second.process.pid}" in first.log()
        assert [e["name"] for e in first.engines()["engines"]] == ["first"]
    finally:
        for load in loads:
            load.stop.set()
        for thread in threads:
            thread.join(timeout=60)
    assert sum(len(load.finished) for load in loads) >= 4
    assert [failure for load in loads for failure in load.failures] == []
    assert "Traceback" not in first.log(), first.log()


def test_a_sleeping_engine_asks_for_its_memory_back_when_it_wakes(
    tmp_path: Path, env: dict[str, str], servers: list[Server]
) -> None:
    first = wait_serving(start(tmp_path, "first", env))
    servers.append(first)
    alone_tokens = first.kv()["max_total_num_tokens"]
    second = wait_serving(start(tmp_path, "second", env))
    servers.append(second)
    assert httpx.post(f"{first.url}/sleep", params={"level": 1}, timeout=60).status_code == 200

    # The second grows into what the first released, until too little is free to wake the first.
    def grown() -> int:
        tokens = second.kv()["max_total_num_tokens"]
        return tokens if tokens >= alone_tokens * 0.9 else 0

    grown_tokens = wait_for("the second to grow into the freed memory", grown, second)
    assert second.kv()["device_free_bytes"] < MIN_TOKENS * first.kv()["bytes_per_token"]

    # The wake asks first: the second gives back (urgently), then the first wakes with its share.
    woke = httpx.post(f"{first.url}/wake_up", timeout=120)
    assert woke.status_code == 200, woke.text + first.log()
    assert woke.json()["to_tokens"] >= MIN_TOKENS and not woke.json()["is_sleeping"]
    assert re.search(r"asked and free after [0-9.]+ s to wake", first.log()), first.log()
    assert second.kv()["max_total_num_tokens"] < grown_tokens
    assert "free memory is" in second.log()  # its urgent give-back's reason
    with httpx.Client(timeout=60) as client:
        answer = client.post(
            f"{first.url}/v1/completions", json={"model": "first", "prompt": "Hello", "max_tokens": 8}
        )
    assert answer.status_code == 200, answer.text
    states = {e["name"]: e["state"] for e in wait_for("the first's turn", lambda: running(first), first)}
    assert states == {"first": "running", "second": "running"}
    for server in (first, second):
        assert "Traceback" not in server.log(), server.log()


def running(server: Server) -> list[dict] | None:
    engines = server.engines()["engines"]
    return engines if all(e["state"] == "running" for e in engines) else None


SIZED = re.compile(r"Post-capture KV sizing: max_total_num_tokens=(\d+)")


def test_two_engines_started_at_the_same_moment_split_the_device_within_ten_percent(
    tmp_path: Path, env: dict[str, str], servers: list[Server]
) -> None:
    """Started together, they agree on their shares at their sizing points (no first-come takes all,
    no commit retry): each one's start-up size is within 10% of even, before any rebalance."""
    pair = [start(tmp_path, name, env) for name in ("left", "right")]
    servers.extend(pair)
    for server in pair:
        wait_serving(server)
    sized = []
    for server in pair:
        match = SIZED.search(server.log())
        assert match, server.log()
        sized.append(int(match.group(1)))
        assert "Traceback" not in server.log(), server.log()
    mean = sum(sized) / 2
    assert all(abs(tokens - mean) <= 0.10 * mean for tokens in sized), sized
    per_token = pair[0].kv()["bytes_per_token"]
    assert sum(sized) * per_token >= 0.6 * DEVICE_GIB * (1 << 30), sized  # the device is used, not idle
    for server, name in zip(pair, ("left", "right"), strict=True):
        assert "retrying with fewer tokens" not in server.log(), server.log()
        body = {"model": name, "prompt": "Hi", "max_tokens": 4}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
