"""`GET /v1/loads` (what a router reads) and `GET /ready` (readiness, beside `/health`'s liveness)."""

from __future__ import annotations

import datetime
import threading
import time

import httpx

from tests.server.conftest import ServerProcess
from tests.server.expect import openai_error


def test_loads_need_the_key_and_report_one_rank_in_smgs_shape(server: ServerProcess) -> None:
    assert "Bearer" in openai_error(httpx.get(f"{server.base_url}/v1/loads"), 401)
    with server.client() as http:
        body = http.get("/v1/loads").json()
        info = http.get("/server_info").json()
    assert datetime.datetime.fromisoformat(body["timestamp"]).tzinfo is not None
    assert body["dp_rank_count"] == 1 and len(body["loads"]) == 1
    (load,) = body["loads"]
    assert load["dp_rank"] == 0
    assert load["max_total_num_tokens"] == info["max_total_num_tokens"]
    assert load["max_running_requests"] == info["max_running_requests"]
    assert 0.0 <= load["cache_hit_rate"] <= 1.0


def test_loads_count_a_running_request_and_the_kv_it_holds(server: ServerProcess) -> None:
    first_token = threading.Event()
    body = {"prompt": "Count slowly: one", "max_tokens": 200, "ignore_eos": True, "stream": True}

    def stream() -> None:
        with server.client(timeout=120) as http, http.stream("POST", "/v1/completions", json=body) as events:
            for line in events.iter_lines():
                if line.startswith("data: "):
                    first_token.set()

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        assert first_token.wait(60)
        with server.client() as http:
            load = http.get("/v1/loads").json()["loads"][0]
    finally:
        thread.join(120)
    assert load["num_running_reqs"] + load["num_waiting_reqs"] == load["num_total_reqs"] >= 1
    assert load["num_used_tokens"] > 0
    assert abs(load["token_usage"] - load["num_used_tokens"] / load["max_total_num_tokens"]) < 1e-3
    with server.client() as http:  # the stream is over: its tokens show in the rate, its KV is free
        deadline = time.monotonic() + 30
        while (idle := http.get("/v1/loads").json()["loads"][0])["num_total_reqs"]:
            assert time.monotonic() < deadline, idle
            time.sleep(0.1)
    assert idle["gen_throughput"] > 0 and idle["num_used_tokens"] == 0


def test_ready_needs_no_key_and_is_503_while_asleep_as_health_stays_200(server: ServerProcess) -> None:
    base = server.base_url
    assert httpx.get(f"{base}/ready").json() == {"status": "ready"}
    with server.client(timeout=120) as http:
        assert http.post("/sleep", params={"level": 1}).status_code == 200
        try:
            asleep = httpx.get(f"{base}/ready")
            assert asleep.json()["error"]["code"] == "engine_asleep" and asleep.status_code == 503
            assert httpx.get(f"{base}/health").status_code == 200  # alive: a liveness probe keeps it
        finally:
            assert http.post("/wake_up").status_code == 200
    assert httpx.get(f"{base}/ready").status_code == 200
