"""Tool calls read back from model output, per call format (no server): Hermes/Qwen `<tool_call>`
blocks, Llama 3.x JSON calls, forced calls; the format follows the chat template."""

from __future__ import annotations

import json

from snugkv.core.outputs import GenerateInput, GenerateOutput
from snugkv.core.sampling import SamplingParams
from snugkv.server.formats import ChoiceState
from snugkv.server.prepare import PreparedRequest
from snugkv.server.tool_format import ToolCallFormat
from snugkv.server.tools import ToolPlan, call_format_of, content_end, parse_tool_calls

TOOLS_NAMES = ("get_weather", "get_time")
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


def test_streaming_holds_only_what_is_or_may_become_a_call() -> None:
    assert content_end(plan(), "Sure, one moment <tool") == len("Sure, one moment ")
    assert content_end(plan(), 'Hi <tool_call>{"na') == len("Hi ")
    assert content_end(plan(), "It is 3 <") == len("It is 3 ") and content_end(plan(), "Sunny") == 5
    assert content_end(plan("llama3"), '{"na') == 0 and content_end(plan("llama3"), "The") == 3


def _stream(tool_plan: ToolPlan, pieces: list[str]) -> list[dict]:
    request = PreparedRequest(
        "r", 0, "m", [GenerateInput("r-0", [1], SamplingParams())], [0], [1], True, False, False
    )
    chat_format, state, deltas = ToolCallFormat(tool_plan), ChoiceState(prompt_tokens=1), []
    for index, piece in enumerate(pieces):
        last = index == len(pieces) - 1
        output = GenerateOutput(
            rid="r-0", token_ids=[5], text=piece, finished=last, finish_reason="stop" if last else None
        )
        state.absorb(output)
        chunk = chat_format.delta(request, 0, output, state)
        if chunk is not None:
            deltas.append(json.loads(chunk.model_dump_json())["choices"][0])
    return deltas


def test_auto_streams_content_then_the_calls_as_tool_call_deltas() -> None:
    pieces = [
        "Let me ",
        "check. <tool",
        '_call>\n{"name": "get_time", ',
        '"arguments": {"timezone": "UTC"}}\n</tool_call>',
    ]
    deltas = _stream(plan(), pieces)
    content = "".join(d["delta"].get("content", "") for d in deltas)
    calls = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    assert content == "Let me check. "
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "get_time", {"timezone": "UTC"})
    ]
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_auto_output_that_was_no_call_streams_as_content_whole() -> None:
    deltas = _stream(plan(), ["I think 2 <", " 3 holds."])
    assert "".join(d["delta"].get("content", "") for d in deltas) == "I think 2 < 3 holds."
    assert deltas[-1]["finish_reason"] == "stop"
    deltas = _stream(plan("llama3"), ["{not json", "}"])
    assert "".join(d["delta"].get("content", "") for d in deltas) == "{not json}"


QWEN_LIKE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}{{ tool.function.name }};{% endfor %}"
    "</tools>\nCall with <tool_call></tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_renders_tools_gets_them_through_apply_chat_template() -> None:
    import copy

    from snugkv.models import default_model
    from snugkv.models.loader import ModelSource
    from snugkv.models.tokenizer import Tokenizer, load_tokenizer
    from snugkv.server.prepare import _chat_prompt_ids
    from snugkv.server.protocol import ChatCompletionRequest
    from snugkv.server.tools import plan_tools

    hf = copy.deepcopy(load_tokenizer(ModelSource(default_model.default_model_path(), "gguf")).hf)
    hf.chat_template = QWEN_LIKE_TEMPLATE
    tokenizer = Tokenizer(hf)  # the project's one tokenizer type, over the changed template
    tools = [
        {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
        for name in TOOLS_NAMES
    ]
    tool_plan = plan_tools(tools, "auto", tokenizer)
    assert tool_plan is not None and tool_plan.template_renders_tools and tool_plan.call_format == "hermes"
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools)
    prompt = tokenizer.decode(_chat_prompt_ids(body, tokenizer, tool_plan), skip_special_tokens=False)
    assert "<tools>get_weather;get_time;</tools>" in prompt
    assert "You may call one or more functions" not in prompt  # the template's own words, not the fallback's
