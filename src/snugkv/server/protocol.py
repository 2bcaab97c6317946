"""The OpenAI completions and chat completions wire format, as pydantic models.

Requests are strict (a string where a number belongs is an error, not a guess). A top-level field
the models do not declare is one of three kinds: one that would change the output but is not
implemented is refused by name (`REFUSED_FIELDS`, the one list of them: remove an entry when its
feature lands); one that changes nothing here (`INFORMATIONAL_FIELDS`: `user`, `metadata`, `store`,
...) is accepted; any other is a 400 "Unrecognized request argument" naming it, as OpenAI answers,
so that a typo (`max_token`) is not silently ignored (`unrecognized_field`). Fields whose JSON may take several shapes
(`prompt`, `stop`, message `content`) are checked by hand so that the error says which shapes are
accepted. Responses mirror OpenAI's field names so the official client parses them unchanged.
This module holds no behaviour beyond shape checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)

from snugkv.core.sampling import MAX_LOGPROBS

PromptInput = str | list[str] | list[int] | list[list[int]]
MAX_CHOICES = 128  # n times the number of prompts


def _bounds(minimum: float, maximum: float | None = None) -> dict[str, Any]:
    """A number's range in the OpenAPI schema."""
    return {"minimum": minimum} if maximum is None else {"minimum": minimum, "maximum": maximum}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's usage in every chunk: refused (`prepare`)


class GenerationRequest(_Request):
    """Fields shared by both endpoints; `top_k`, `min_p`, `min_tokens`, `repetition_penalty`,
    `ignore_eos` and `stop_token_ids` are extensions (vLLM's names)."""

    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields: see `refused_field`

    # `_bounds` only describe the ranges in the OpenAPI schema (server/openapi.py); the checks, with
    # their messages, are prepare's and SamplingParams'.
    model: str | None = None
    n: int = Field(1, json_schema_extra=_bounds(1, MAX_CHOICES))
    max_tokens: int | None = Field(None, json_schema_extra=_bounds(0))
    temperature: float | None = Field(None, json_schema_extra=_bounds(0, 100))
    top_p: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    top_k: int | None = Field(None, json_schema_extra=_bounds(-1))
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, json_schema_extra=_bounds(0, 2**63 - 1))
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, json_schema_extra=_bounds(-2, 2))
    frequency_penalty: float | None = Field(None, json_schema_extra=_bounds(-2, 2))
    repetition_penalty: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 100})
    min_p: float | None = Field(None, json_schema_extra=_bounds(0, 1))
    min_tokens: int | None = Field(None, json_schema_extra=_bounds(0))
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

    @field_validator("stop", mode="plain", json_schema_input_type=str | list[str] | None)
    @classmethod
    def _stop_shape(cls, value: Any) -> str | list[str] | None:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return value
        raise ValueError("use a string or a list of strings")


class CompletionRequest(GenerationRequest):
    prompt: PromptInput
    logprobs: int | None = Field(None, json_schema_extra=_bounds(0, MAX_LOGPROBS))
    echo: bool = False
    # vLLM's extension: top alternatives per prompt position
    prompt_logprobs: int | None = Field(None, json_schema_extra=_bounds(0, MAX_LOGPROBS))
    best_of: int | None = None

    @field_validator("prompt", mode="plain", json_schema_input_type=PromptInput)
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


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(_Request):
    role: str = Field(json_schema_extra={"enum": list(CHAT_ROLES)})
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="plain", json_schema_input_type=str | list[dict[str, Any]] | None)
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
    top_logprobs: int | None = Field(None, json_schema_extra=_bounds(0, MAX_LOGPROBS))
    max_completion_tokens: int | None = Field(None, json_schema_extra=_bounds(1))
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extension, on the rendered template; not streamed
    prompt_logprobs: int | None = Field(None, json_schema_extra=_bounds(0, MAX_LOGPROBS))


def _unset(value: Any) -> bool:
    return value is None


def _unset_or_empty(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


def _falsy(value: Any) -> bool:
    return value is None or value is False


def _unset_or(*inert: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in inert


@dataclass(frozen=True, slots=True)
class RefusedField:
    """A request field this server does not implement although it would change the output.

    `inert(value)` is True for the values that ask for what the server does anyway (e.g.
    `skip_special_tokens: true`), which are accepted. `endpoints` limits the refusal to
    "completions" or "chat" where the other endpoint implements the field or never sees it."""

    what: str  # what the field asks for, as the error message names it
    inert: Callable[[Any], bool] = _unset
    endpoints: frozenset[str] = frozenset({"completions", "chat"})
    instead: str | None = None  # what to do instead, where there is more to say than "remove it"


_STRUCTURED = "structured output"
# `tools` and `tool_choice` are implemented; the legacy function fields are not, and their refusal
# points to the fields that do the same.
_LEGACY_FUNCTIONS = "OpenAI's legacy function calling"
_AS_TOOLS = (
    'send each function as a tool instead, tools: [{"type": "function", "function": {...}}], '
    "with tool_choice for function_call (tool calling is supported)"
)

# The one list of fields refused by name: remove an entry when its feature lands.
REFUSED_FIELDS: dict[str, RefusedField] = {
    "guided_whitespace_pattern": RefusedField(_STRUCTURED),
    "structured_outputs": RefusedField(_STRUCTURED),
    "functions": RefusedField(_LEGACY_FUNCTIONS, _unset_or_empty, instead=_AS_TOOLS),
    "function_call": RefusedField(_LEGACY_FUNCTIONS, _unset_or("none", "auto"), instead=_AS_TOOLS),
    "suffix": RefusedField(
        "text after the insertion point (suffix)", _unset_or_empty, frozenset({"completions"})
    ),
    "use_beam_search": RefusedField("beam search", _falsy),
    "length_penalty": RefusedField("beam search's length penalty", _unset_or(1, 1.0)),
    "bad_words": RefusedField("banned words", _unset_or_empty),
    "allowed_token_ids": RefusedField("a list of allowed tokens", _unset_or_empty),
    "truncate_prompt_tokens": RefusedField("prompt truncation"),
    "include_stop_str_in_output": RefusedField("stop strings in the output", _falsy),
    "skip_special_tokens": RefusedField("special tokens in the text", _unset_or(True)),
    "spaces_between_special_tokens": RefusedField("the spacing of special tokens", _unset_or(True)),
    "typical_p": RefusedField("typical sampling", _unset_or(1, 1.0)),
    "top_a": RefusedField("top-a sampling", _unset_or(0, 0.0)),
    "tfs": RefusedField("tail-free sampling", _unset_or(1, 1.0)),
    "mirostat": RefusedField("mirostat sampling", _unset_or(0)),
    "no_repeat_ngram_size": RefusedField("n-gram blocking", _unset_or(0)),
    "logits_processors": RefusedField("custom logits processors", _unset_or_empty),
    "prediction": RefusedField("predicted outputs"),
    "audio": RefusedField("audio output"),
    "modalities": RefusedField("other output modalities", _unset_or(["text"])),
    "reasoning_effort": RefusedField("a reasoning effort"),
    "verbosity": RefusedField("a verbosity level", _unset_or("medium")),
    "web_search_options": RefusedField("web search", _unset_or_empty, frozenset({"chat"})),
    "return_tokens_as_token_ids": RefusedField("tokens written as token ids", _falsy),
    "best_of": RefusedField(
        "the best of several completions",
        _unset_or(1),
        frozenset({"chat"}),
        "remove best_of (n gives several choices)",
    ),
    "top_logprobs": RefusedField(
        "chat's alternatives per token",
        endpoints=frozenset({"completions"}),
        instead="on /v1/completions set logprobs to the number of alternatives",
    ),
    "chat_template": RefusedField("a chat template of the request's own", endpoints=frozenset({"chat"})),
    "chat_template_kwargs": RefusedField("chat template options", _unset_or_empty, frozenset({"chat"})),
    "continue_final_message": RefusedField("continuing the last message", _falsy, frozenset({"chat"})),
    "add_generation_prompt": RefusedField(
        "a prompt without the generation prompt", _unset_or(True), frozenset({"chat"})
    ),
    "documents": RefusedField("documents for the chat template", _unset_or_empty, frozenset({"chat"})),
    "echo": RefusedField("echoing the last message", _falsy, frozenset({"chat"})),
    "moderation": RefusedField("content moderation", _unset_or_empty),
}


# Fields OpenAI's and vLLM's clients send that change nothing this server computes: who asks
# (user, safety_identifier, metadata), what the provider stores or bills (store, service_tier),
# prompt-cache routing (prompt_cache_*, cache_salt), vLLM's request_id and scheduling priority.
INFORMATIONAL_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "cache_salt",
        "request_id",
        "priority",
    }
)


def unrecognized_field(request: GenerationRequest, endpoint: str) -> str | None:
    """The first top-level field of `request` that its model does not declare, `REFUSED_FIELDS`
    does not name on `endpoint` ("completions" or "chat") and `INFORMATIONAL_FIELDS` does not
    hold, or None."""
    for name in request.model_extra or {}:
        refused = REFUSED_FIELDS.get(name)
        if (refused is None or endpoint not in refused.endpoints) and name not in INFORMATIONAL_FIELDS:
            return name
    return None


def refused_field(request: GenerationRequest, endpoint: str) -> tuple[str, RefusedField] | None:
    """The first field of `request` that `REFUSED_FIELDS` refuses on `endpoint` ("completions" or
    "chat") with a value that would change the output, or None."""
    given = {name: getattr(request, name) for name in request.model_fields_set}
    given.update(request.model_extra or {})
    for name, value in given.items():
        refused = REFUSED_FIELDS.get(name)
        if refused is not None and endpoint in refused.endpoints and not refused.inert(value):
            return name, refused
    return None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None
    # with speculative decoding on: accepted_prediction_tokens (draft tokens the model kept) and
    # rejected_prediction_tokens (draft tokens it judged and dropped), OpenAI's fields of the names
    completion_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs; with `echo` the prompt's first token has null entries."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One entry of vLLM's `prompt_logprobs` (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str


class _Choice(BaseModel):
    """A choice's `finish_detail` (snugkv's own reason when `finish_reason` alone would mislead, e.g.
    "kv_capacity") and `prompt_logprobs` (asked for) appear only when set; the other fields keep
    OpenAI's explicit nulls."""

    @model_serializer(mode="wrap")
    def _omit_unset_extensions(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in ("finish_detail", "prompt_logprobs"):
            if data.get(name, "") is None:
                del data[name]
        return data


class CompletionChoice(_Choice):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    finish_detail: str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


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
    """`prompt_logprobs` (vLLM's, top-level: every choice has the same prompt) appears only when
    the request asked for it."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None

    @model_serializer(mode="wrap")
    def _omit_unasked_prompt_logprobs(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("prompt_logprobs", "") is None:
            del data["prompt_logprobs"]
        return data


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
