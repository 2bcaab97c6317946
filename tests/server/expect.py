"""Checks shared by the server tests: the OpenAI error shape, SSE parsing, what the engine aborted."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx


def openai_error(response: httpx.Response, status: int, *, param: str | None = None) -> str:
    """Asserts the OpenAI error shape with `status`; returns the message for further checks."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and len(error["message"]) > 20, error
    assert error["type"], error
    if param is not None:
        assert error["param"] == param, error
    return error["message"]


def sse_events(response: httpx.Response) -> list[Any]:
    """The JSON payloads of a complete event stream; asserts it ends with `[DONE]`."""
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.strip()]
    assert payloads[-1] == "[DONE]", payloads[-3:]
    return [json.loads(payload) for payload in payloads[:-1]]


def aborted_rids(client: httpx.Client) -> set[str]:
    """The request ids the engine has seen `abort` for (reported in /server_info)."""
    return set(client.get("/server_info").json()["aborted_rids"])


def wait_for(
    condition: Any,
    timeout_s: float = 10.0,
    what: str = "condition",
    poll_s: float = 0.02,
    detail: Any = None,
) -> Any:
    """`condition()`'s first truthy value; on a timeout an AssertionError naming `what`, followed
    by `detail()` when given (a server's log)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)
    extra = f":\n{detail()}" if detail is not None else ""
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}{extra}")
