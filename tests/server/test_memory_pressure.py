"""A real server (SmolLM2 on CPU) on a simulated shared device another process fills: its KV cache
gives up the deficit when the other takes memory below its headroom, round after round down to
its least; with the device full, a prompt that fits its reserve but not its cache of now waits for memory and is a 503
with Retry-After when none comes, and runs once the other process ends; /metrics counts the moves
and GET /kv shows them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.scheduler.test_pressure import Hog
from tests.server.conftest import ServerProcess, start_server
from tests.server.expect import openai_error

# End to end (make test-fast leaves it out): a real server process beside another one.
pytestmark = pytest.mark.slow

DEVICE_MIB = 64
HEADROOM_MIB = 16
PAGE_TOKENS = 4  # serve_for_tests' page size
QUEUE_TIMEOUT_S = 2.0


@pytest.fixture()
def shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerProcess]:
    monkeypatch.setenv("SNUGKV_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("SNUGKV_HOST_DEVICE_GIB", str(DEVICE_MIB / 1024))
    monkeypatch.setenv("SNUGKV_HOST_DEVICE_HEADROOM_MIB", str(HEADROOM_MIB))
    server = start_server(tmp_path, "--queue-timeout", str(QUEUE_TIMEOUT_S))
    yield server
    assert server.stop() == 0, server.log()


def kv_tokens(http: httpx.Client) -> int:
    tokens: int = http.get("/kv").json()["max_total_num_tokens"]
    return tokens


def wait_for(check: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("the server never got there")


def test_a_full_device_queues_a_long_prompt_into_a_503_then_serves_it_once_memory_is_back(
    shared: ServerProcess,
) -> None:
    body = {"prompt": "word " * 120, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    hog = Hog()
    try:
        with shared.client() as http:
            startup = kv_tokens(http)
            reference = http.post("/v1/completions", json=body)
            assert reference.status_code == 200, reference.text
            free = http.get("/kv").json()["device_free_bytes"]
            hog.take(free // 2)  # the other process leaves half the headroom free: the cache gives the rest
            wait_for(lambda: http.get("/kv").json()["device_free_bytes"] >= HEADROOM_MIB * 2**20)
            assert 0 < kv_tokens(http) < startup
            for _ in range(
                20
            ):  # the other takes all but 2 MiB, round after round: the cache goes to its least
                before = kv_tokens(http)
                if before == 2 * PAGE_TOKENS:
                    break
                hog.take(-2 * 2**20)
                wait_for(lambda: kv_tokens(http) < before)  # noqa: B023 (called at once)
            assert kv_tokens(http) == 2 * PAGE_TOKENS

            started = time.monotonic()
            refused = http.post("/v1/completions", json=body)
            waited_s = time.monotonic() - started
            assert refused.status_code == 503, refused.text
            assert int(refused.headers["Retry-After"]) >= 1
            assert "try again later" in refused.json()["error"]["message"]
            assert QUEUE_TIMEOUT_S <= waited_s < QUEUE_TIMEOUT_S + 5

            never = {**body, "prompt": "word " * 600}  # over the model's context: no memory helps
            openai_error(http.post("/v1/completions", json=never), 400, param="prompt")

            answer: dict[str, httpx.Response] = {}
            waiting = threading.Thread(
                target=lambda: answer.update(r=http.post("/v1/completions", json=body))
            )
            waiting.start()
            time.sleep(0.5)
            hog.end()  # memory comes back while the request waits: the cache grows and it runs
            waiting.join(timeout=30)
            assert answer["r"].status_code == 200, answer["r"].text
            assert answer["r"].json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
            wait_for(lambda: kv_tokens(http) == startup)

            reasons = [event["reason"] for event in http.get("/kv").json()["events"]]
            assert reasons.count("pressure") >= 2 and reasons[-1] == "pressure-grow"
            metrics = http.get("/metrics").text
            assert f"snugkv_kv_pressure_shrinks_total {reasons.count('pressure')}.0" in metrics
            # grown back to all (a grow needs only 0.5% of the reserve more free: one or a few steps)
            assert reasons.count("pressure-grow") >= 1
            assert f"snugkv_kv_pressure_grows_total {reasons.count('pressure-grow')}.0" in metrics
            assert "snugkv_oom_retries_total 0.0" in metrics
            assert http.get("/server_info").json()["slot_accounting_when_idle"].get("ok", True)
    finally:
        hog.end()
