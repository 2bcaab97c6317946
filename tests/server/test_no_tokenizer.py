"""A model without tokenizer files (a tiny Llama with random weights) behind the real app: token-id
prompts are served, and what needs text (echo, a text prompt, stop strings, chat) is a 400 saying
to send token ids, never a 500; the engine goes on and every slot comes back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from snugkv.driver.engine_core import EngineCore
from snugkv.driver.engine_thread import EngineThread
from snugkv.engine import Engine, EngineArgs
from snugkv.server.app import create_app
from tests.models.hf_tiny import save_tiny_hf_model
from tests.server.expect import openai_error


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, EngineThread]]:
    folder = tmp_path_factory.mktemp("no-tokenizer")
    save_tiny_hf_model("llama", folder)
    engine = Engine(
        EngineArgs.of(model=str(folder), dtype="float32", host_kv_gib=0.02, max_running_requests=4)
    )
    async_engine = EngineThread(EngineCore.around(engine, tokenizer=None), model_name="tiny")
    app = create_app(async_engine, api_key=None, max_body_bytes=1 << 20, served_model_name="tiny")
    with TestClient(app) as client:
        yield client, async_engine
    async_engine.stop()


def post(client: TestClient, path: str, body: dict[str, Any]) -> Any:
    return client.post(path, json=body)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": [5, 6, 7], "echo": True, "logprobs": 1, "max_tokens": 2}, "echo"),
        ("/v1/completions", {"prompt": [5, 6, 7], "echo": True, "max_tokens": 0, "logprobs": 0}, "echo"),
        ("/v1/completions", {"prompt": "text", "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": [5, 6], "stop": ["x"], "max_tokens": 2}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ],
    ids=["echo with logprobs", "echo scoring only", "text prompt", "stop strings", "chat"],
)
def test_what_needs_text_is_a_400_saying_to_send_token_ids(served, path, body, param) -> None:
    client, _ = served
    message = openai_error(post(client, path, body), 400, param=param)
    assert "tokenizer" in message and "token ids" in message


def test_token_id_prompts_are_served_and_every_slot_comes_back(served) -> None:
    client, async_engine = served
    response = post(client, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    scored = post(client, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1, "prompt_logprobs": 1})
    assert scored.status_code == 200, scored.text
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        accounting = async_engine.server_info().slot_accounting_when_idle
        if accounting.checked and not async_engine.scheduler.has_work:
            break
        time.sleep(0.05)
    assert accounting.ok, accounting
