"""Many clients at once, clients that leave mid-request, and engine failures stay contained."""

from __future__ import annotations

import asyncio
import re
import threading

import httpx
import pytest

from tests.server.conftest import API_KEY, ENGINE, ServerProcess
from tests.server.expect import aborted_rids, openai_error, sse_events, wait_for
from tests.server.fake_engine import ENGINE_ERROR_MARKER

CLIENTS = 40
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}


def running_requests(client: httpx.Client) -> float:
    """The engine's running-request gauge, as Prometheus scrapes it."""
    text = client.get("/metrics").text
    return float(re.search(r"^snugkv_num_requests_running (\S+)$", text, re.MULTILINE).group(1))


async def one_client(http: httpx.AsyncClient, index: int) -> tuple[str, str, int]:
    """Alternates completions/chat and JSON/SSE; returns (id, text, completion tokens)."""
    stream, chat = index % 2 == 1, index % 4 >= 2
    body: dict = {"max_tokens": 8, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Client {index} says hello."}]
    else:
        body["prompt"] = f"Client {index} says"
    response = await http.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if not stream:
        result = response.json()
        choice = result["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return result["id"], text, result["usage"]["completion_tokens"]
    events = sse_events(response)
    pieces = [
        (c["delta"].get("content", "") if chat else c["text"]) for event in events for c in event["choices"]
    ]
    return events[0]["id"], "".join(pieces), events[-1]["usage"]["completion_tokens"]


def test_forty_concurrent_clients_all_get_complete_answers(
    server: ServerProcess, client: httpx.Client
) -> None:
    async def run_all() -> list[tuple[str, str, int]]:
        limits = httpx.Limits(max_connections=CLIENTS)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(
            base_url=server.base_url, headers=headers, timeout=60, limits=limits
        ) as http:
            return await asyncio.gather(*(one_client(http, index) for index in range(CLIENTS)))

    results = asyncio.run(run_all())
    assert len({request_id for request_id, _, _ in results}) == CLIENTS
    assert all(text and 0 < tokens <= 8 for _, text, tokens in results), results
    wait_for(lambda: running_requests(client) == 0, what="the engine to finish every request")


def test_closing_a_stream_mid_way_aborts_its_engine_request(
    server: ServerProcess, client: httpx.Client
) -> None:
    with (
        server.client() as http,
        http.stream(
            "POST", "/v1/completions", json={"prompt": "Tell a long story", "stream": True, **LONG}
        ) as response,
    ):
        assert response.status_code == 200
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        first = next(lines)
        next(lines), next(lines)
    rid = re.search(r'"id":"([^"]+)"', first).group(1) + "-0"
    wait_for(lambda: rid in aborted_rids(client), what=f"the engine to see abort({rid})")
    assert client.post("/v1/completions", json={"prompt": "next", "max_tokens": 2}).status_code == 200


def test_leaving_a_non_streamed_request_aborts_it(server: ServerProcess, client: httpx.Client) -> None:
    before = aborted_rids(client)
    with server.client(timeout=httpx.Timeout(30.0, read=0.3)) as impatient, pytest.raises(httpx.ReadTimeout):
        impatient.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Go on"}], **LONG}
        )
    new = wait_for(lambda: aborted_rids(client) - before, what="the engine to see an abort")
    assert all(rid.startswith("chatcmpl-") for rid in new), new


def test_closing_one_of_n_streams_aborts_every_choice(server: ServerProcess, client: httpx.Client) -> None:
    with (
        server.client() as http,
        http.stream(
            "POST", "/v1/completions", json={"prompt": "Many", "n": 3, "stream": True, **LONG}
        ) as response,
    ):
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
    request_id = re.search(r'"id":"([^"]+)"', first).group(1)
    expected = {f"{request_id}-{index}" for index in range(3)}
    wait_for(lambda: expected <= aborted_rids(client), what=f"aborts of {sorted(expected)}")


@pytest.mark.skipif(ENGINE != "fake", reason="injects a failure through the fake engine")
def test_an_engine_error_fails_only_its_own_request(server: ServerProcess, client: httpx.Client) -> None:
    healthy_result: dict = {}

    def healthy() -> None:
        with server.client() as http:
            healthy_result["response"] = http.post(
                "/v1/completions", json={"prompt": "fine", "max_tokens": 50}
            )

    neighbour = threading.Thread(target=healthy)
    neighbour.start()
    failing = client.post("/v1/completions", json={"prompt": f"x {ENGINE_ERROR_MARKER}", "max_tokens": 5})
    assert "injected failure" in openai_error(failing, 500)
    streamed = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": ENGINE_ERROR_MARKER}],
            "stream": True,
            "max_tokens": 5,
        },
    )
    events = sse_events(streamed)
    assert "injected failure" in events[-1]["error"]["message"]
    neighbour.join()
    assert healthy_result["response"].status_code == 200
    assert client.get("/health").status_code == 200


@pytest.mark.skipif(ENGINE != "real", reason="slot accounting is the real engine's")
def test_after_the_workload_every_slot_is_back_and_the_server_still_answers(
    server: ServerProcess, client: httpx.Client
) -> None:
    def idle_accounting() -> dict | None:
        info = client.get("/server_info").json()
        accounting = info["slot_accounting_when_idle"]
        return accounting if info["stats"]["num_running_requests"] == 0 and accounting["checked"] else None

    accounting = wait_for(idle_accounting, timeout_s=60)
    assert accounting["ok"], accounting["detail"]
    assert accounting["free_tokens"] + accounting["cached_tokens"] == accounting["capacity_tokens"]
    response = client.post("/v1/completions", json={"prompt": "Still here?", "max_tokens": 4})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
