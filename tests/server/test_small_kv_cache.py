"""A server whose KV cache is smaller than the model's context (`--max-total-tokens 64`): what it
says it can take is what it takes, and a request that can never fit is refused the same way
whether streamed or not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ServerProcess, start_server
from tests.server.expect import openai_error

# End to end (make test-fast leaves it out): real server processes with small KV caches.
pytestmark = pytest.mark.slow

KV_TOKENS = 64
PAGE_TOKENS = 4  # serve_for_tests' page size


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(Path(tmp_path_factory.mktemp("small-kv")), "--max-total-tokens", str(KV_TOKENS))
    yield server
    assert server.stop() == 0, server.log()


def test_max_model_len_is_what_the_kv_cache_can_take(small: ServerProcess) -> None:
    with small.client() as http:
        card = http.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == KV_TOKENS - PAGE_TOKENS + 1  # a prompt plus one page to grow into


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_a_request_that_can_never_fit_is_a_400_streamed_or_not(small: ServerProcess, stream: bool) -> None:
    body = {"prompt": "word " * 100, "max_tokens": 2, "stream": stream}
    with small.client() as http:
        message = openai_error(http.post("/v1/completions", json=body), 400, param="prompt")
    assert "this server's KV cache" in message and str(KV_TOKENS - PAGE_TOKENS + 1) in message


def test_a_request_within_the_limit_runs(small: ServerProcess) -> None:
    with small.client() as http:
        response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def test_chat_without_max_tokens_is_bounded_by_the_kv_cache(small: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True, "stream": True}
    with small.client() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        text = "".join(response.iter_text())
    assert '"finish_reason":"length"' in text and "error" not in text, text[-400:]


def test_health(small: ServerProcess) -> None:
    assert httpx.get(f"{small.base_url}/health", timeout=10).status_code == 200
