"""Tools on chat completions: which tools the model sees, how they reach the prompt, and the tool
calls read back from its output.

`plan_tools` checks `tools` and `tool_choice` and settles a `ToolPlan`: the call format (Hermes/Qwen
`<tool_call>` blocks, or Llama 3.x JSON calls, told apart by the chat template), and, for
`tool_choice: "required"` or a named function, the structured output that forces a valid call (a
named function's output is its arguments, held to the function's JSON schema; "required" is a
JSON array of `{"name", "arguments"}` calls over the tools' schemas). A template that renders
`tools` itself gets them; one that does not (SmolLM2's) gets the tools in a system message in the
Hermes format, and earlier calls and results as text. `parse_tool_calls` turns a finished output
into OpenAI `tool_calls`. `tool_choice: "none"` keeps the tools out of the prompt altogether.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from snugkv.core.structured_output import StructuredOutput
from snugkv.core.tokenizer import Tokenizer
from snugkv.server.errors import bad_request
from snugkv.server.guided import check

ToolMode = Literal["auto", "required", "named"]
CallFormat = Literal["hermes", "llama3"]
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA_PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: tuple[dict[str, Any], ...]  # the `function` objects: name, description, parameters
    mode: ToolMode
    call_format: CallFormat
    template_renders_tools: bool
    named: str | None = None  # the function `tool_choice` names
    structured: StructuredOutput | None = None  # what forces the call (required, named)

    def function(self, name: str) -> dict[str, Any] | None:
        return next((tool for tool in self.tools if tool["name"] == name), None)


def _functions(tools: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    functions = []
    for index, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise bad_request(
                f'tools[{index}] must be {{"type": "function", "function": {{"name": ...}}}}.', param="tools"
            )
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise bad_request(
                f"tools[{index}].function.name must be 1 to 64 letters, digits, _ . or -.", param="tools"
            )
        parameters = function.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise bad_request(
                f"tools[{index}].function.parameters must be a JSON schema object.", param="tools"
            )
        functions.append({**function, "parameters": parameters})
    return tuple(functions)


def template_source(tokenizer: Tokenizer | None) -> str:
    """The chat template's Jinja source ("" when the model has none)."""
    template = tokenizer.hf.chat_template if tokenizer is not None and tokenizer.has_chat_template else None
    return template if isinstance(template, str) else ""


def call_format_of(template: str) -> CallFormat:
    """Llama 3.x templates speak of `ipython` and the python tag; everything else gets Hermes blocks."""
    if LLAMA_PYTHON_TAG in template or "ipython" in template:
        return "llama3"
    return "hermes"


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    tokenizer: Tokenizer | None,
    *,
    parallel_tool_calls: bool = True,
) -> ToolPlan | None:
    """The tools of a chat request and how they run (None: no tools, or `tool_choice: "none"`);
    `parallel_tool_calls=False` holds a forced call to one."""
    if not tools or tool_choice == "none":
        if tool_choice not in (None, "none", "auto") and not tools:
            raise bad_request(
                "tool_choice needs tools; send tools or remove tool_choice.", param="tool_choice"
            )
        return None
    functions = _functions(tools)
    template = template_source(tokenizer)
    mode: ToolMode
    named = None
    if tool_choice in (None, "auto"):
        mode = "auto"
    elif tool_choice == "required":
        mode = "required"
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        mode, named = "named", tool_choice["function"].get("name")
        if not any(function["name"] == named for function in functions):
            raise bad_request(
                f"tool_choice names {named!r}, which is not one of the tools.", param="tool_choice"
            )
    else:
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}.',
            param="tool_choice",
        )
    plan = ToolPlan(functions, mode, call_format_of(template), "tools" in template, named)
    structured = _forcing_output(plan, parallel_tool_calls)
    if structured is not None:
        check(structured, "tools")
    return ToolPlan(plan.tools, mode, plan.call_format, plan.template_renders_tools, named, structured)


def _forcing_output(plan: ToolPlan, parallel_tool_calls: bool) -> StructuredOutput | None:
    if plan.mode == "named":
        function = plan.function(plan.named or "")
        assert function is not None  # plan_tools checked the name
        return StructuredOutput("json_schema", json.dumps(function["parameters"]))
    if plan.mode == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"enum": [tool["name"]]}, "arguments": tool["parameters"]},
                "required": ["name", "arguments"],
            }
            for tool in plan.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return StructuredOutput("json_schema", json.dumps(schema))
    return None


def _hermes_system_text(plan: ToolPlan) -> str:
    listed = "\n".join(json.dumps({"type": "function", "function": tool}) for tool in plan.tools)
    return (
        "You may call one or more functions to assist with the user query. The functions are listed "
        f"within <tools></tools>:\n<tools>\n{listed}\n</tools>\n\nFor each function call, return a JSON "
        "object with the function name and arguments within <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def render_messages(
    plan: ToolPlan, messages: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages and the extra `apply_chat_template` arguments that put the tools in the prompt."""
    if plan.template_renders_tools:
        tools = [{"type": "function", "function": tool} for tool in plan.tools]
        return messages, {"tools": tools}
    rendered: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            rendered.append(
                {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
            )
        elif message.get("tool_calls"):
            blocks = [
                f"{HERMES_OPEN}\n{json.dumps({'name': call['function']['name'], 'arguments': call['function']['arguments']})}\n{HERMES_CLOSE}"
                for call in message["tool_calls"]
            ]
            rendered.append(
                {"role": "assistant", "content": "\n".join([message["content"] or "", *blocks]).strip()}
            )
        else:
            rendered.append({"role": message["role"], "content": message["content"]})
    system = _hermes_system_text(plan)
    if rendered and rendered[0]["role"] == "system":
        rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{system}"}
    else:
        rendered.insert(0, {"role": "system", "content": system})
    return rendered, {}


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """An OpenAI tool call; `arguments` as a JSON string."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": text},
    }


def _call_from(obj: Any, plan: ToolPlan) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if plan.function(obj["name"]) is None:
        return None
    return tool_call(obj["name"], arguments)


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The content left and the tool calls in a finished output (no calls: the text is content)."""
    if plan.mode == "named":
        assert plan.named is not None
        try:
            return None, [tool_call(plan.named, json.loads(text))]
        except json.JSONDecodeError:
            return text, []  # cut short (max_tokens): not a valid call
    if plan.mode == "required":
        try:
            parsed = [_call_from(obj, plan) for obj in json.loads(text)]
        except (json.JSONDecodeError, TypeError):
            return text, []
        return None, [call for call in parsed if call is not None]
    calls: list[dict[str, Any]] = []
    if plan.call_format == "hermes":
        for block in _HERMES_BLOCK.findall(text):
            try:
                call = _call_from(json.loads(block), plan)
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
        if not calls:
            return text, []
        content = text[: text.find(HERMES_OPEN)].strip()
        return content or None, calls
    body = text.strip().removeprefix(LLAMA_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    for part in body.split(";"):
        try:
            call = _call_from(json.loads(part), plan)
        except json.JSONDecodeError:
            return text, []
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


def content_end(plan: ToolPlan, text: str) -> int:
    """How much of `text`, output so far, can stream as content now: all of it but what is or may
    become a tool call (a Hermes block, or a partial `<tool_call>` at its end; Llama 3.x calls are the
    whole output, so output that starts like JSON or the python tag is held)."""
    if plan.mode != "auto":
        return 0
    if plan.call_format == "hermes":
        found = text.find(HERMES_OPEN)
        if found >= 0:
            return found
        for length in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
            if text.endswith(HERMES_OPEN[:length]):
                return len(text) - length
        return len(text)
    start = text.lstrip()
    if any(start.startswith(m) or m.startswith(start) for m in (LLAMA_PYTHON_TAG, "{")):
        return 0
    return len(text)
