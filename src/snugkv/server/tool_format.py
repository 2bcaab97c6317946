"""Chat responses of a request with tools: `message.tool_calls`, or tool-call deltas when streamed.

A named function's arguments stream as they come (the output is the arguments); a "required" call
is sent whole when the output ends; with "auto", text streams as content up to where a tool call
starts or may start (`tools.content_end`), and what is held is sent at the end as tool-call deltas,
or as content if it was no call. A choice that called tools finishes with "tool_calls". Asked-for
`logprobs` come per token as on plain chat (streamed with the step that made them, text held or not).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from snugkv.core.outputs import GenerateOutput
from snugkv.server.formats import (
    ChatFormat,
    ChoiceState,
    chat_logprobs,
    chat_prompt_logprobs,
    usage_of,
)
from snugkv.server.prepare import PreparedRequest
from snugkv.server.protocol import AssistantMessage, ChatChoice, ChatCompletionResponse, ChatStreamChoice
from snugkv.server.tools import ToolPlan, content_end, parse_tool_calls, tool_call


@dataclass(slots=True)
class _Stream:
    sent_chars: int = 0  # of the choice's text, sent as content or arguments
    call_id: str | None = None  # a named function's call, once opened


class ToolCallFormat(ChatFormat):
    plain_text_deltas = False  # its deltas hold back or re-route text (server/sse.py must not template them)

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._streams: dict[int, _Stream] = {}

    def delta(
        self, prepared: PreparedRequest, index: int, output: GenerateOutput, state: ChoiceState
    ) -> BaseModel | None:
        stream = self._streams.setdefault(index, _Stream())
        text = "".join(state.text)
        delta: dict[str, object] = {}
        finish_reason = state.finish_reason
        if self.plan.mode == "named":
            assert self.plan.named is not None
            if stream.call_id is None:
                opened = tool_call(self.plan.named, "")
                stream.call_id = str(opened["id"])
                delta["tool_calls"] = [
                    {"index": 0, **opened, "function": {**opened["function"], "arguments": text}}
                ]
            elif len(text) > stream.sent_chars:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": text[stream.sent_chars :]}}]
            stream.sent_chars = len(text)
            if output.finished and finish_reason == "stop":
                finish_reason = "tool_calls"
        else:
            end = content_end(self.plan, text)
            if output.finished:
                _, calls = parse_tool_calls(self.plan, text)
                if calls:
                    delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
                else:
                    end = len(text)
            if end > stream.sent_chars:
                delta["content"] = text[stream.sent_chars : end]
                stream.sent_chars = end
        # A token's logprobs go out with the step that made it, even while its text is held back.
        logprobs = chat_logprobs(output.logprobs) if prepared.logprobs and output.logprobs else None
        if not delta and not output.finished and logprobs is None:
            return None
        choice = ChatStreamChoice(
            index=index,
            delta=delta,
            logprobs=logprobs,
            finish_reason=finish_reason,
            finish_detail=state.finish_detail,
        )
        return self._chunk(prepared, [choice])

    def response(self, prepared: PreparedRequest, choices: list[ChoiceState]) -> BaseModel:
        built = []
        for index, state in enumerate(choices):
            content, calls = parse_tool_calls(self.plan, "".join(state.text))
            finish_reason = "tool_calls" if calls and state.finish_reason == "stop" else state.finish_reason
            built.append(
                ChatChoice(
                    index=index,
                    message=AssistantMessage(content=content, tool_calls=calls or None),
                    logprobs=chat_logprobs(state.logprobs) if prepared.logprobs else None,
                    finish_reason=finish_reason,
                    finish_detail=state.finish_detail,
                )
            )
        return ChatCompletionResponse(
            id=prepared.request_id,
            created=prepared.created,
            model=prepared.model,
            choices=built,
            usage=usage_of(prepared, choices),
            prompt_logprobs=chat_prompt_logprobs(prepared, choices),
        )
