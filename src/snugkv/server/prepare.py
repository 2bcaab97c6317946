"""From a parsed OpenAI request to the `GenerateInput`s the engine runs.

Owns everything that can reject a request before the engine sees it: the model name, options this
server does not support, sampling values (through `SamplingParams.validate`), prompt shapes, the
chat template and the context limit. Each rejection is an `APIError` whose message says what to
change. One request fans out into `n` engine requests per prompt, each with its own rid and seed.
Never calls `generate`; never holds state between requests.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from snugkv.core.engine_client import EngineClient
from snugkv.core.outputs import GenerateInput
from snugkv.core.sampling import MAX_LOGPROBS, InvalidRequest, SamplingParams
from snugkv.core.tokenizer import Tokenizer
from snugkv.server.errors import APIError, bad_request, from_validation_error
from snugkv.server.guided import requested_structured_output
from snugkv.server.protocol import (
    CHAT_ROLES,
    INFORMATIONAL_FIELDS,
    MAX_CHOICES,
    REFUSED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    refused_field,
    unrecognized_field,
)
from snugkv.server.tools import ToolPlan, plan_tools, render_messages

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
SEED_MODULUS = 2**63

JSON_KINDS = {
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}

RequestModel = TypeVar("RequestModel", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class SequenceLimit:
    """The most tokens one request may take (prompt plus new tokens), and what sets that limit."""

    tokens: int
    what: str  # "the model's context" or "this server's KV cache"

    @classmethod
    def of(cls, client: EngineClient) -> SequenceLimit:
        """The model's context, or less when the KV cache is smaller (e.g. --max-total-tokens 64).

        The engine refuses a prompt that, with one page to grow into, is larger than the whole KV
        cache it could hold (one it holds less of now waits for memory: a 503 if none comes); checked here, such a request is a 400 whether streamed or not, and /v1/models says the
        limit. (An engine that cannot answer leaves the context as the limit; its own refusal is then
        the backstop.)
        """
        context = SequenceLimit(client.max_context_tokens, "the model's context")
        try:
            info = client.server_info()
        except Exception:
            return context
        # What the allocator hands out (a sliding-window model's can be below max_total_num_tokens),
        # or what it could grow to: a request that fits only that waits in the engine for memory.
        kv_tokens, page_tokens = info.kv_max_capacity_tokens or info.kv_capacity_tokens, info.page_size
        if 0 < kv_tokens - page_tokens + 1 < context.tokens:
            return SequenceLimit(kv_tokens - page_tokens + 1, "this server's KV cache")
        return context


@dataclass(frozen=True, slots=True)
class EchoedPrompt:
    """What `echo` puts before a completion: the prompt's text and its first token's text (the
    one token without a log-probability)."""

    text: str
    first_token: str


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """One HTTP request, ready to run: choice `i` is `inputs[i]`, from prompt `prompt_of_choice[i]`.

    `echo[p]` is prompt p's text when the completion starts with it; `echo_logprobs` and
    `prompt_logprobs` are how many alternatives the echoed tokens and vLLM's `prompt_logprobs`
    show per position (None: not asked)."""

    request_id: str
    created: int
    model: str
    inputs: list[GenerateInput]
    prompt_of_choice: list[int]
    prompt_tokens: list[int]
    stream: bool
    include_usage: bool
    logprobs: bool
    tools: ToolPlan | None = None  # chat with tools: how calls are read back (server.tools)
    echo: list[EchoedPrompt] | None = None
    echo_logprobs: int | None = None
    prompt_logprobs: int | None = None


def parse_body(raw: bytes, model: type[RequestModel]) -> RequestModel:
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        data = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError:
        raise bad_request("The request body is not UTF-8 text; send a UTF-8 encoded JSON object.") from None
    except json.JSONDecodeError as exc:
        raise bad_request(
            f"The request body is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
            "send a JSON object."
        ) from None
    except RecursionError:
        raise bad_request("The request body nests arrays or objects too deeply; flatten it.") from None
    if not isinstance(data, dict):
        kind = JSON_KINDS.get(type(data), type(data).__name__)
        raise bad_request(f"The request body must be a JSON object, not a JSON {kind}.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def prepare_completion(
    body: CompletionRequest, client: EngineClient, served_model_name: str, limit: SequenceLimit
) -> PreparedRequest:
    _check_common(body, served_model_name, "completions")
    _check_stop_token_ids(body, client.tokenizer)
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of is not supported; remove it or set it equal to n.", param="best_of")
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
    # Echoed tokens carry `logprobs` alternatives, vLLM's `prompt_logprobs` its own count: the engine
    # computes the larger. An echo of no new tokens scores nothing but still runs the prompt once.
    echo_logprobs = body.logprobs if body.echo else None
    asked = [count for count in (echo_logprobs, body.prompt_logprobs) if count is not None]
    if body.echo and max_tokens == 0 and not asked:
        asked = [0]
    sampling = _sampling(
        body,
        max_tokens,
        body.logprobs,
        limit,
        prompt_logprobs=max(asked, default=None),
        tokenizer=client.tokenizer,
    )
    sampling = dataclasses.replace(sampling, structured=requested_structured_output(body))
    raw_prompts = _split_prompts(body.prompt)
    if client.tokenizer is None:
        _check_needs_no_tokenizer(body, raw_prompts)
    prompts = [_completion_prompt_ids(prompt, client.tokenizer) for prompt in raw_prompts]
    for index, ids in enumerate(prompts):
        name = "prompt" if len(prompts) == 1 else f"prompt[{index}]"
        _check_token_ids(ids, client.tokenizer, name)
        _check_fits(len(ids), sampling.max_new_tokens, limit, what=f"The {name}", param="prompt")
    prepared = _fan_out(
        "cmpl", body, served_model_name, prompts, sampling, logprobs=body.logprobs is not None
    )
    echo = None
    if body.echo:
        echo = [_echoed(raw, ids, client.tokenizer) for raw, ids in zip(raw_prompts, prompts)]
    return dataclasses.replace(
        prepared, echo=echo, echo_logprobs=echo_logprobs, prompt_logprobs=body.prompt_logprobs
    )


def _check_needs_no_tokenizer(body: CompletionRequest, raw_prompts: list[str | list[int]]) -> None:
    """A model without tokenizer files (random weights from a bare config.json) takes and gives
    token ids only: text in (a prompt string, stop strings) or text out of the prompt (echo) has
    no tokenizer to go through."""
    needs = None
    if any(isinstance(prompt, str) for prompt in raw_prompts):
        needs, param = "A text prompt", "prompt"
    elif body.echo:
        needs, param = "echo", "echo"
    elif body.stop:
        needs, param = "stop strings", "stop"
    if needs is not None:
        raise bad_request(
            f"{needs} needs the model's tokenizer, and this server's model has none (its directory holds no "
            "tokenizer files); send the prompt as token ids, with stop_token_ids for stop strings and "
            "without echo.",
            param=param,
            code="no_tokenizer",
        )


def _echoed(raw: str | list[int], ids: list[int], tokenizer: Tokenizer | None) -> EchoedPrompt:
    tokenizer = _needed(tokenizer, "echo")
    text = raw if isinstance(raw, str) else tokenizer.decode(ids)
    return EchoedPrompt(text=text, first_token=tokenizer.decode(ids[:1]))


def prepare_chat(
    body: ChatCompletionRequest, client: EngineClient, served_model_name: str, limit: SequenceLimit
) -> PreparedRequest:
    _check_common(body, served_model_name, "chat")
    if client.tokenizer is None:
        raise bad_request(
            "Chat needs the model's tokenizer and chat template, and this server's model has none (its "
            "directory holds no tokenizer files); send token ids to /v1/completions instead.",
            param="messages",
            code="no_tokenizer",
        )
    _check_stop_token_ids(body, client.tokenizer)
    parallel_tool_calls = body.parallel_tool_calls is not False
    tools = plan_tools(
        body.tools, body.tool_choice, client.tokenizer, parallel_tool_calls=parallel_tool_calls
    )
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true.", param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise bad_request(
            f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {body.top_logprobs}.",
            param="top_logprobs",
        )
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if body.stream and body.prompt_logprobs is not None:
        raise bad_request(
            "prompt_logprobs cannot be streamed on chat; set stream to false or remove prompt_logprobs.",
            param="prompt_logprobs",
        )
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    sampling = _sampling(
        body,
        max_tokens,
        top_logprobs,
        limit,
        prompt_logprobs=body.prompt_logprobs,
        tokenizer=client.tokenizer,
    )
    structured = requested_structured_output(body)
    if tools is not None and tools.structured is not None:
        if structured is not None:
            raise bad_request(
                "tool_choice forces a tool call, which cannot be combined with response_format or "
                "guided_*; remove one of them.",
                param="tool_choice",
            )
        structured = tools.structured
    sampling = dataclasses.replace(sampling, structured=structured)
    ids = _chat_prompt_ids(body, client.tokenizer, tools)
    if max_tokens is None:
        if len(ids) >= limit.tokens:
            raise bad_request(
                f"The messages take {len(ids)} tokens, which leaves no room to answer in {limit.what} "
                f"of {limit.tokens} tokens; shorten the messages.",
                param="messages",
                code="context_length_exceeded",
            )
        room = limit.tokens - len(ids)
        if sampling.min_tokens > room:
            raise bad_request(
                f"min_tokens={sampling.min_tokens} is more than the {room} tokens the messages leave in "
                f"{limit.what} of {limit.tokens} tokens; ask for fewer or shorten the messages.",
                param="min_tokens",
            )
        sampling = dataclasses.replace(sampling, max_new_tokens=room)
    _check_fits(len(ids), sampling.max_new_tokens, limit, what="The messages", param="messages")
    prepared = _fan_out("chatcmpl", body, served_model_name, [ids], sampling, logprobs=body.logprobs)
    return dataclasses.replace(prepared, tools=tools, prompt_logprobs=body.prompt_logprobs)


def _check_common(body: GenerationRequest, served_model_name: str, endpoint: str) -> None:
    if body.model is not None and body.model != served_model_name:
        raise APIError(
            404,
            f"The model '{body.model}' does not exist here; this server serves '{served_model_name}' "
            "(see GET /v1/models).",
            param="model",
            code="model_not_found",
        )
    if not 1 <= body.n <= MAX_CHOICES:
        raise bad_request(f"n must be between 1 and {MAX_CHOICES}, got {body.n}.", param="n")
    unknown = unrecognized_field(body, endpoint)
    if unknown is not None:
        declared = [*type(body).model_fields, *REFUSED_FIELDS, *INFORMATIONAL_FIELDS]
        close = difflib.get_close_matches(unknown, declared, n=1)
        hint = f"did you mean {close[0]}?" if close else "remove it"
        raise bad_request(
            f"Unrecognized request argument supplied: {unknown}; {hint} (this endpoint takes "
            "OpenAI's fields and vLLM's extensions, see the README)",
            param=unknown,
            code="unrecognized_argument",
        )
    refused = refused_field(body, endpoint)
    if refused is not None:
        name, field = refused
        instead = field.instead or f"remove {name}"
        raise bad_request(
            f"{name} asks for {field.what}, which this server does not support yet; {instead}.",
            param=name,
        )
    if body.stream_options is not None and body.stream_options.continuous_usage_stats:
        raise bad_request(
            "stream_options.continuous_usage_stats asks for usage in every chunk, which this server "
            "does not support yet; use include_usage for usage in the last chunk.",
            param="stream_options",
        )


def _logit_bias(body: GenerationRequest, tokenizer: Tokenizer | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` as `(id, bias)` pairs, ids checked against the vocabulary."""
    pairs = []
    vocab_size = _vocab_size(tokenizer)
    for key, bias in (body.logit_bias or {}).items():
        if not key.strip().isdigit():
            raise bad_request(
                f'logit_bias has the key {key!r}; keys are token ids written as strings, such as "50256".',
                param="logit_bias",
            )
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise bad_request(
                f"logit_bias[{key!r}] is {bias!r}; each bias is a number between -100 and 100.",
                param="logit_bias",
            )
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise bad_request(
                f"logit_bias names token {token}, which is not a token of this model; ids must be "
                f"0 to {vocab_size - 1}.",
                param="logit_bias",
            )
        pairs.append((token, float(bias)))
    return tuple(pairs)


def _sampling(
    body: GenerationRequest,
    max_tokens: int | None,
    logprobs: int | None,
    limit: SequenceLimit,
    *,
    prompt_logprobs: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> SamplingParams:
    """Sampling values checked against the engine's rules; `max_tokens=None` is settled later.
    A refusal names the field the client wrote (chat's `max_completion_tokens` or `max_tokens`)."""
    max_tokens_name = "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens_name = "max_completion_tokens"
    if max_tokens is not None and max_tokens > limit.tokens:
        raise bad_request(
            f"{max_tokens_name}={max_tokens} exceeds {limit.what} of {limit.tokens} tokens; ask for fewer tokens.",
            param=max_tokens_name,
        )
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    top_k = body.top_k if body.top_k is not None else 0
    try:
        sampling = SamplingParams(
            # no limit given (chat): a placeholder until the room is known, never below min_tokens
            max_new_tokens=max_tokens if max_tokens is not None else max(1, body.min_tokens or 0),
            temperature=body.temperature if body.temperature is not None else 1.0,
            top_p=body.top_p if body.top_p is not None else 1.0,
            top_k=0 if top_k == -1 else top_k,  # -1 disables top-k in vLLM's dialect
            seed=body.seed,
            stop=stop,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty if body.repetition_penalty is not None else 1.0,
            logit_bias=_logit_bias(body, tokenizer),
            min_p=body.min_p or 0.0,
            min_tokens=body.min_tokens or 0,
            max_tokens_name=max_tokens_name,
        )
        sampling.validate(limit.tokens)
    except InvalidRequest as exc:
        raise bad_request(f"{exc}.", param=exc.param) from None
    return sampling


def _split_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _completion_prompt_ids(prompt: str | list[int], tokenizer: Tokenizer | None) -> list[int]:
    if isinstance(prompt, list):
        return list(prompt)
    _check_text(prompt, "prompt")
    return _needed(tokenizer, "A text prompt").encode(prompt)


def _check_text(text: str, param: str) -> None:
    """Text a tokenizer can take: valid Unicode (JSON can carry lone surrogates such as \\ud800)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(
            f"The {param} contains {text[exc.start]!r} at position {exc.start}, half of a UTF-16 surrogate "
            "pair, which is not text; send the whole pair or remove it.",
            param=param,
        ) from None


def _check_token_ids(ids: list[int], tokenizer: Tokenizer | None, param: str) -> None:
    if not ids:
        raise bad_request(f"The {param} is empty; send at least one token.", param="prompt")
    vocab_size = _vocab_size(tokenizer)
    bad = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if bad is not None:
        bound = f"0 to {vocab_size - 1}" if vocab_size is not None else "non-negative"
        raise bad_request(
            f"Token id {bad} in the {param} is out of range; ids must be {bound}.", param="prompt"
        )


def _check_stop_token_ids(body: GenerationRequest, tokenizer: Tokenizer | None) -> None:
    vocab_size = _vocab_size(tokenizer)
    for token in body.stop_token_ids or ():
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            bound = f"0 to {vocab_size - 1}" if vocab_size is not None else "non-negative"
            raise bad_request(
                f"stop_token_ids has {token}, which is not a token of this model; ids must be {bound}.",
                param="stop_token_ids",
            )


def _vocab_size(tokenizer: Tokenizer | None) -> int | None:
    return None if tokenizer is None else tokenizer.vocab_size


def _needed(tokenizer: Tokenizer | None, what: str) -> Tokenizer:
    """The tokenizer, or a 400 saying that this model has none (send token ids)."""
    if tokenizer is None:
        raise bad_request(
            f"{what} needs the model's tokenizer, and this model ships none; send the prompt as token ids."
        )
    return tokenizer


def _check_fits(
    prompt_tokens: int, max_new_tokens: int, limit: SequenceLimit, *, what: str, param: str
) -> None:
    limit_tokens = limit.tokens
    needed = prompt_tokens + max_new_tokens
    if needed <= limit_tokens:
        return
    over = needed - limit_tokens
    if prompt_tokens >= limit_tokens:
        message = (
            f"{what} takes {prompt_tokens} tokens, {prompt_tokens - limit_tokens + 1} more than fit in "
            f"{limit.what} of {limit_tokens} tokens with room for one new token; shorten it."
        )
    else:
        message = (
            f"{what} takes {prompt_tokens} tokens and max_tokens is {max_new_tokens}: {needed} tokens, "
            f"{over} over {limit.what} of {limit_tokens}; shorten the prompt or lower max_tokens "
            f"to at most {limit_tokens - prompt_tokens}."
        )
    raise bad_request(message, param=param, code="context_length_exceeded")


def _chat_prompt_ids(
    body: ChatCompletionRequest, tokenizer: Tokenizer | None, tools: ToolPlan | None = None
) -> list[int]:
    if not body.messages:
        raise bad_request("messages is empty; send at least one message.", param="messages")
    tokenizer = _needed(tokenizer, "a chat")
    messages = [_template_message(index, message) for index, message in enumerate(body.messages)]
    try:
        if tools is not None:  # the template takes the tools too: the transformers tokenizer's own call
            messages, extra = render_messages(tools, messages)
            text = tokenizer.hf.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **extra
            )
            ids = tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special ones
        else:
            ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    except Exception as exc:  # template errors come as jinja2, ValueError or TypeError
        raise bad_request(
            f"The model's chat template rejected these messages ({exc}); check the roles and their order.",
            param="messages",
        ) from None
    if not ids:
        raise bad_request("The messages render to an empty prompt; send some content.", param="messages")
    return ids


def _template_message(index: int, message: Any) -> dict[str, Any]:
    if message.role not in CHAT_ROLES:
        raise bad_request(
            f"messages[{index}].role is '{message.role}'; use one of {', '.join(CHAT_ROLES)}.",
            param=f"messages[{index}].role",
        )
    role = "system" if message.role == "developer" else message.role
    content = message.content
    if isinstance(content, list):
        texts = []
        for part_index, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"messages[{index}].content[{part_index}] has type {part.get('type')!r}; "
                    'only {"type": "text", "text": ...} parts are supported.',
                    param=f"messages[{index}].content",
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    _check_text(content or "", f"messages[{index}].content")
    rendered: dict[str, Any] = {"role": role, "content": content or ""}
    if message.tool_calls:
        rendered["tool_calls"] = message.tool_calls
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _fan_out(
    kind: str,
    body: GenerationRequest,
    model: str,
    prompts: list[list[int]],
    sampling: SamplingParams,
    *,
    logprobs: bool,
) -> PreparedRequest:
    if len(prompts) * body.n > MAX_CHOICES:
        raise bad_request(
            f"{len(prompts)} prompts times n={body.n} is {len(prompts) * body.n} completions, more than "
            f"{MAX_CHOICES}; send fewer prompts or a smaller n.",
            param="n",
        )
    request_id = f"{kind}-{uuid.uuid4().hex}"
    inputs: list[GenerateInput] = []
    prompt_of_choice: list[int] = []
    for prompt_index, ids in enumerate(prompts):
        for _ in range(body.n):
            choice = len(inputs)
            seed = None if sampling.seed is None else (sampling.seed + choice) % SEED_MODULUS
            choice_sampling = dataclasses.replace(sampling, seed=seed)
            inputs.append(
                GenerateInput(rid=f"{request_id}-{choice}", input_ids=ids, sampling=choice_sampling)
            )
            prompt_of_choice.append(prompt_index)
    return PreparedRequest(
        request_id=request_id,
        created=int(time.time()),
        model=model,
        inputs=inputs,
        prompt_of_choice=prompt_of_choice,
        prompt_tokens=[len(ids) for ids in prompts],
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        logprobs=logprobs,
    )
