"""Tools on chat completions against the real server (embedded SmolLM2, whose template ignores
tools, so they reach the prompt in the Hermes format): a forced call returns valid arguments,
streamed as tool-call deltas; "none" keeps the tools out of the prompt; bad tools are a 400."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from tests.server.conftest import ENGINE  # noqa: E402
from tests.server.expect import openai_error, sse_events  # noqa: E402

pytestmark = pytest.mark.skipif(ENGINE != "real", reason="tools need the real engine")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(client: httpx.Client, **body: object) -> dict:
    payload = {"messages": ASK, "max_tokens": 120, "temperature": 0, **body}
    response = client.post("/v1/chat/completions", json=payload)
    assert response.status_code == 200, response.text
    return response.json()


def assert_valid_calls(calls: list[dict]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


def test_required_tool_choice_returns_valid_arguments(client: httpx.Client) -> None:
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 11}):
        body = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
        choice = chat(client, **body, **sampling)["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None
        assert_valid_calls(choice["message"]["tool_calls"])
        assert len(choice["message"]["tool_calls"]) == 1


def test_a_named_function_is_called_with_valid_arguments(client: httpx.Client) -> None:
    tool_choice = {"type": "function", "function": {"name": "get_time"}}
    choice = chat(client, tools=TOOLS, tool_choice=tool_choice)["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert [call["function"]["name"] for call in calls] == ["get_time"]
    assert_valid_calls(calls)
    assert choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_streamed_tool_call_arrives_as_tool_call_deltas(client: httpx.Client, tool_choice: object) -> None:
    payload = {
        "messages": ASK,
        "max_tokens": 120,
        "temperature": 0,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "stream": True,
        "parallel_tool_calls": False,
    }
    events = sse_events(client.post("/v1/chat/completions", json=payload))
    deltas = [event["choices"][0]["delta"] for event in events if event["choices"]]
    assert not any(delta.get("content") for delta in deltas)
    calls: dict[int, dict] = {}
    for delta in deltas:
        for part in delta.get("tool_calls", []):
            call = calls.setdefault(
                part["index"],
                {"id": part.get("id"), "type": "function", "function": {"name": "", "arguments": ""}},
            )
            call["function"]["name"] += part.get("function", {}).get("name", "")
            call["function"]["arguments"] += part.get("function", {}).get("arguments", "")
    assert_valid_calls(list(calls.values()))
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "tool_calls"


def test_tool_choice_none_keeps_the_tools_out_of_the_prompt(client: httpx.Client) -> None:
    plain = chat(client, max_tokens=8)
    none = chat(client, max_tokens=8, tools=TOOLS, tool_choice="none")
    auto = chat(client, max_tokens=8, tools=TOOLS)
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert none["choices"][0]["message"] == plain["choices"][0]["message"]
    assert "tool_calls" not in none["choices"][0]["message"]
    assert auto["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 50  # the tools, rendered


def test_a_conversation_with_earlier_calls_and_results_renders(client: httpx.Client) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"timezone": "CET"}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "14:05"},
    ]
    choice = chat(client, messages=messages, tools=TOOLS, max_tokens=8)["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope'",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0]"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "required"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"},
            "tool_choice",
            "cannot be combined",
        ),
    ],
)
def test_bad_tools_are_a_400(client: httpx.Client, body: dict, param: str, words: str) -> None:
    response = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert words in openai_error(response, 400, param=param)


def test_logprobs_come_with_tool_calls_whole_and_streamed(client: httpx.Client) -> None:
    """`logprobs` with tools is not dropped: one entry per generated token, the same when streamed
    (where "auto" holds text back until it knows whether a call starts)."""
    body = {"tools": TOOLS, "tool_choice": "auto", "logprobs": True, "top_logprobs": 2}
    answer = chat(client, **body)
    choice = answer["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == answer["usage"]["completion_tokens"]
    assert all(entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2 for entry in content)
    payload = {"messages": ASK, "max_tokens": 120, "temperature": 0, "stream": True, **body}
    events = sse_events(client.post("/v1/chat/completions", json=payload))
    streamed = [
        e
        for event in events
        if event["choices"]
        for e in (event["choices"][0]["logprobs"] or {}).get("content", [])
    ]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
