"""Tool calls read back from model output, per call format (no server): Hermes/Qwen `<tool_call>`
blocks, Llama 3.x JSON calls, forced calls; the format follows the chat template."""

from __future__ import annotations

import json

from snugkv.server.tools import ToolPlan, call_format_of, may_be_tool_call, parse_tool_calls

TOOLS = (
    {"name": "get_weather", "parameters": {"type": "object"}},
    {"name": "get_time", "parameters": {"type": "object"}},
)


def plan(call_format: str = "hermes", mode: str = "auto", named: str | None = None) -> ToolPlan:
    return ToolPlan(TOOLS, mode, call_format, False, named)  # type: ignore[arg-type]


def test_hermes_blocks_become_tool_calls_and_text_before_them_content() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(plan(), text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"timezone": "CET"}),
    ]
    assert len({c["id"] for c in calls}) == 2


def test_llama3_json_calls_with_or_without_the_python_tag() -> None:
    for text in (
        '{"name": "get_time", "parameters": {"timezone": "UTC"}}',
        '<|python_tag|>{"name": "get_time", "parameters": {"timezone": "UTC"}}',
    ):
        content, calls = parse_tool_calls(plan("llama3"), text)
        assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"timezone": "UTC"}


def test_text_that_is_no_call_stays_content() -> None:
    for call_format in ("hermes", "llama3"):
        assert parse_tool_calls(plan(call_format), "It is sunny.") == ("It is sunny.", [])
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse_tool_calls(plan(), unknown) == (unknown, [])


def test_forced_calls_parse_the_whole_output() -> None:
    _, calls = parse_tool_calls(plan(mode="named", named="get_time"), '{"timezone": "UTC"}')
    assert calls[0]["function"] == {"name": "get_time", "arguments": '{"timezone": "UTC"}'}
    _, calls = parse_tool_calls(
        plan(mode="required"), '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    )
    assert calls[0]["function"]["name"] == "get_weather"
    assert parse_tool_calls(plan(mode="named", named="get_time"), '{"timez') == ('{"timez', [])  # cut short


def test_the_call_format_follows_the_chat_template() -> None:
    assert call_format_of("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert call_format_of("<|start_header_id|>ipython<|end_header_id|>") == "llama3"
    assert call_format_of("") == "hermes"


def test_streaming_holds_only_what_may_become_a_call() -> None:
    assert may_be_tool_call(plan(), "<tool") and may_be_tool_call(plan(), " <tool_call>{")
    assert not may_be_tool_call(plan(), "Sure")
    assert may_be_tool_call(plan("llama3"), '{"na') and not may_be_tool_call(plan("llama3"), "The")
