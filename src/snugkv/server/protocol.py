"""The OpenAI completions and chat completions wire format, as pydantic models.

Requests are strict (a string where a number belongs is an error, not a guess) and ignore
fields they do not know, as OpenAI clients send extras. Fields whose JSON may take several shapes
(`prompt`, `stop`, message `content`) are checked by hand so that the error says which shapes are
accepted. Responses mirror OpenAI's field names so the official client parses them unchanged.
This module holds no behaviour beyond shape checks.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)

PromptInput = str | list[str] | list[int] | list[list[int]]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class GenerationRequest(_Request):
    """Fields shared by both endpoints; `top_k`, `ignore_eos` and `stop_token_ids` are extensions."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    # Structured output (snugkv.server.guided): OpenAI's, vLLM's and SGLang's names.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop_shape(cls, value: Any) -> str | list[str] | None:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return value
        raise ValueError("use a string or a list of strings")


class CompletionRequest(GenerationRequest):
    prompt: PromptInput
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt_shape(cls, value: Any) -> PromptInput:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            if all(isinstance(item, str) for item in value):
                return value
            if all(_is_token_id(item) for item in value):
                return value
            if all(isinstance(item, list) and all(_is_token_id(t) for t in item) for item in value):
                return value
        if isinstance(value, list) and not value:
            raise ValueError("send a string or at least one token id, not an empty list")
        raise ValueError(
            "use a string, a list of strings, a list of token ids or a list of lists of token ids"
        )


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ChatMessage(_Request):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="plain")
    @classmethod
    def _content_shape(cls, value: Any) -> str | list[dict[str, Any]] | None:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(part, dict) for part in value):
            return value
        raise ValueError('use a string or a list of {"type": "text", "text": ...} parts')


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class _Choice(BaseModel):
    """A choice's `finish_detail` (snugkv's own reason when `finish_reason` alone would mislead, e.g.
    "abort") appears only when set; the other fields keep OpenAI's explicit nulls."""

    @model_serializer(mode="wrap")
    def _omit_empty_finish_detail(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("finish_detail", "") is None:
            del data["finish_detail"]
        return data


class CompletionChoice(_Choice):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    finish_detail: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    """`tool_calls` appears only when the model called tools (then `content` may be null)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _omit_no_tool_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("tool_calls", "") is None:
            del data["tool_calls"]
        return data


class ChatChoice(_Choice):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    finish_detail: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ChatStreamChoice(_Choice):
    index: int
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    finish_detail: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "snugkv"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
