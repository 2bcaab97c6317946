"""The API key guards everything but /health; models, server info and Prometheus metrics answer."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import ServerProcess
from tests.server.expect import openai_error


def test_health_needs_no_key(server: ServerProcess) -> None:
    response = httpx.get(f"{server.base_url}/health")
    assert response.status_code == 200


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/server_info"),
        ("GET", "/get_server_info"),
        ("GET", "/metrics"),
        ("GET", "/no/such/route"),
    ],
)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", "Basic c25ha2U6b2ls"])
def test_everything_else_needs_the_key(
    server: ServerProcess, method: str, path: str, authorization: str | None
) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    response = httpx.request(method, f"{server.base_url}{path}", headers=headers, json={"prompt": "x"})
    message = openai_error(response, 401)
    assert "Bearer" in message
    assert response.json()["error"]["type"] == "authentication_error"


def test_models_lists_the_served_model_with_its_context(client: httpx.Client) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["object"] == "model" and card["id"] and card["max_model_len"] > 0
    assert client.get(f"/v1/models/{card['id']}").json()["id"] == card["id"]
    openai_error(client.get("/v1/models/not-this-one"), 404)


def test_server_info_and_its_alias_report_the_engine(client: httpx.Client) -> None:
    info = client.get("/server_info").json()
    assert client.get("/get_server_info").json().keys() == info.keys()
    assert info["max_total_num_tokens"] > 0
    assert "sizing_mode" in info and "memory_ledger" in info


def test_a_bad_query_value_gets_a_400_naming_it(client: httpx.Client) -> None:
    message = openai_error(client.get("/server_info", params={"steps": "maybe"}), 400)
    assert "'steps'" in message and "boolean" in message and "'maybe'" in message
    assert client.get("/server_info", params={"steps": "false"}).status_code == 200  # the server goes on


def test_metrics_expose_kv_queue_cache_throughput_and_latency(client: httpx.Client) -> None:
    # all 4 tokens (a sampled end of text would finish it by "stop" and leave the "length" count out)
    body = {"prompt": "count me", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["finish_reason"] == "length"
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in (
        "snugkv_kv_cache_usage_ratio",
        "snugkv_num_requests_running",
        "snugkv_num_requests_waiting",
        "snugkv_prefix_cache_hit_rate",
        "snugkv_generation_tokens_per_second",
        "snugkv_generation_tokens_total",
        "snugkv_time_to_first_token_seconds_bucket",
        "snugkv_time_per_output_token_seconds_bucket",
        'snugkv_requests_finished_total{finish_reason="length"}',
    ):
        assert name in text, name
