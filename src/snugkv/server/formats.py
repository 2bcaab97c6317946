"""The OpenAI response shapes of a generation: one JSON body, or chunk by chunk for SSE.

`ChoiceState` accumulates what one choice produced; `CompletionFormat` and `ChatFormat` turn engine
outputs and those states into the wire models of `protocol`. Pure functions of their inputs: no
I/O, no engine, no timing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pydantic import BaseModel

from snugkv.core.outputs import GenerateOutput, TokenLogprob
from snugkv.server.prepare import EchoedPrompt, PreparedRequest
from snugkv.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    PromptLogprob,
    TopLogprob,
    UsageInfo,
)


@dataclass(slots=True)
class ChoiceState:
    """What one choice has produced so far."""

    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # arrives once, with the first output
    counted_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    draft_tokens: int | None = None  # speculative decoding's, from the last output (None: off)
    accepted_draft_tokens: int = 0
    text_chars: int = 0
    latest_text_offset: int = 0  # where the text of the output absorbed last starts
    finish_reason: str | None = None  # OpenAI's value
    finish_detail: str | None = None  # the engine's own reason, where OpenAI's alone would mislead

    def absorb(self, output: GenerateOutput) -> None:
        self.text.append(output.text)
        self.latest_text_offset = self.text_chars
        self.text_chars += len(output.text)
        self.logprobs.extend(output.logprobs)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.counted_tokens += len(output.token_ids)
        self.completion_tokens = max(self.counted_tokens, output.completion_tokens)
        self.prompt_tokens = output.prompt_tokens or self.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, output.cached_tokens)
        if output.draft_tokens is not None:
            self.draft_tokens, self.accepted_draft_tokens = output.draft_tokens, output.accepted_draft_tokens
        if output.finished:
            self.finish_reason, self.finish_detail = openai_finish_reason(output.finish_reason)


def openai_finish_reason(engine_reason: str | None) -> tuple[str, str | None]:
    """The `finish_reason` a client sees for the engine's, and the engine's own in `finish_detail`
    where the two differ.

    "abort" (cut off before the model finished: the server is stopping, or the request was
    cancelled) stays "abort", vLLM's value for it, so a client can tell a cut answer from a
    finished one and send it again; it is not one of OpenAI's values, and the openai client
    passes it through as a string. "kv_capacity" (the KV cache could not hold the next token) is
    OpenAI's "length" (the text is cut at a size limit), with "kv_capacity" as its detail.
    """
    if engine_reason in (None, "stop", "length", "abort"):
        return engine_reason or "stop", None
    return "length", engine_reason


def usage_of(prepared: PreparedRequest, choices: list[ChoiceState]) -> UsageInfo:
    """Each prompt counts once however many choices it has, as OpenAI counts it."""
    prompt = list(prepared.prompt_tokens)
    cached = [0] * len(prompt)
    for state, prompt_index in zip(choices, prepared.prompt_of_choice):
        prompt[prompt_index] = max(prompt[prompt_index], state.prompt_tokens)
        cached[prompt_index] = max(cached[prompt_index], state.cached_tokens)
    completion = sum(state.completion_tokens for state in choices)
    speculated = [state for state in choices if state.draft_tokens is not None]
    details = None
    if speculated:  # the engine speculates: what its drafts gave, over every choice
        accepted = sum(state.accepted_draft_tokens for state in speculated)
        drafted = sum(state.draft_tokens or 0 for state in speculated)
        details = {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": drafted - accepted}
    return UsageInfo(
        prompt_tokens=sum(prompt),
        completion_tokens=completion,
        total_tokens=sum(prompt) + completion,
        prompt_tokens_details={"cached_tokens": sum(cached)},
        completion_tokens_details=details,
    )


class CompletionFormat:
    """Chunks and responses of POST /v1/completions. With `echo` the prompt's text (and its tokens'
    logprobs, the first null as OpenAI has it) comes first, in the first chunk when streamed, and
    every text offset counts from the prompt's start; vLLM's `prompt_logprobs` is per choice."""

    # (server/sse.py) `delta` of an unfinished text-only output depends on its text alone, so the
    # server may write such chunks from a template: set False where a delta transforms its text.
    plain_text_deltas = True

    def opening(self, prepared: PreparedRequest) -> list[BaseModel]:
        return []

    def delta(
        self, prepared: PreparedRequest, index: int, output: GenerateOutput, state: ChoiceState
    ) -> BaseModel | None:
        echo = prepared.echo[prepared.prompt_of_choice[index]] if prepared.echo else None
        first = state.counted_tokens == len(output.token_ids)  # `absorb` took this output already
        echo_text = echo.text if echo is not None and first else ""
        shift = len(echo.text) if echo is not None else 0
        logprobs = None
        if prepared.logprobs:
            entries = _echo_entries(prepared, echo, output.prompt_logprobs) if echo_text else []
            logprobs = _completion_logprobs(
                entries + list(output.logprobs), state.latest_text_offset + shift - len(echo_text)
            )
        if not output.text and not echo_text and not output.finished and not output.logprobs:
            return None
        choice = CompletionChoice(
            index=index,
            text=echo_text + output.text,
            logprobs=logprobs,
            finish_reason=state.finish_reason,
            finish_detail=state.finish_detail,
            prompt_logprobs=_vllm_prompt_logprobs(prepared, output.prompt_logprobs),
        )
        return CompletionChunk(
            id=prepared.request_id, created=prepared.created, model=prepared.model, choices=[choice]
        )

    def usage_chunk(self, prepared: PreparedRequest, usage: UsageInfo) -> BaseModel:
        return CompletionChunk(
            id=prepared.request_id, created=prepared.created, model=prepared.model, choices=[], usage=usage
        )

    def response(self, prepared: PreparedRequest, choices: list[ChoiceState]) -> BaseModel:
        return CompletionResponse(
            id=prepared.request_id,
            created=prepared.created,
            model=prepared.model,
            choices=[self._choice(prepared, index, state) for index, state in enumerate(choices)],
            usage=usage_of(prepared, choices),
        )

    def _choice(self, prepared: PreparedRequest, index: int, state: ChoiceState) -> CompletionChoice:
        echo = prepared.echo[prepared.prompt_of_choice[index]] if prepared.echo else None
        logprobs = None
        if prepared.logprobs:
            entries = _echo_entries(prepared, echo, state.prompt_logprobs) if echo is not None else []
            logprobs = _completion_logprobs([*entries, *state.logprobs], 0)
        return CompletionChoice(
            index=index,
            text=(echo.text if echo is not None else "") + "".join(state.text),
            logprobs=logprobs,
            finish_reason=state.finish_reason,
            finish_detail=state.finish_detail,
            prompt_logprobs=_vllm_prompt_logprobs(prepared, state.prompt_logprobs),
        )


class ChatFormat:
    """Chunks and responses of POST /v1/chat/completions."""

    plain_text_deltas = True  # as CompletionFormat's (server/sse.py)

    def opening(self, prepared: PreparedRequest) -> list[BaseModel]:
        choices = [
            ChatStreamChoice(index=index, delta={"role": "assistant", "content": ""})
            for index in range(len(prepared.inputs))
        ]
        return [self._chunk(prepared, choices)]

    def delta(
        self, prepared: PreparedRequest, index: int, output: GenerateOutput, state: ChoiceState
    ) -> BaseModel | None:
        if not output.text and not output.finished and not output.logprobs:
            return None
        logprobs = chat_logprobs(output.logprobs) if prepared.logprobs else None
        delta = {"content": output.text} if output.text else {}
        choice = ChatStreamChoice(
            index=index,
            delta=delta,
            logprobs=logprobs,
            finish_reason=state.finish_reason,
            finish_detail=state.finish_detail,
        )
        return self._chunk(prepared, [choice])

    def usage_chunk(self, prepared: PreparedRequest, usage: UsageInfo) -> BaseModel:
        return ChatCompletionChunk(
            id=prepared.request_id, created=prepared.created, model=prepared.model, choices=[], usage=usage
        )

    def response(self, prepared: PreparedRequest, choices: list[ChoiceState]) -> BaseModel:
        return ChatCompletionResponse(
            id=prepared.request_id,
            created=prepared.created,
            model=prepared.model,
            choices=[
                ChatChoice(
                    index=index,
                    message=AssistantMessage(content="".join(state.text)),
                    logprobs=chat_logprobs(state.logprobs) if prepared.logprobs else None,
                    finish_reason=state.finish_reason,
                    finish_detail=state.finish_detail,
                )
                for index, state in enumerate(choices)
            ],
            usage=usage_of(prepared, choices),
            prompt_logprobs=chat_prompt_logprobs(prepared, choices),
        )

    def _chunk(self, prepared: PreparedRequest, choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=prepared.request_id, created=prepared.created, model=prepared.model, choices=choices
        )


ResponseFormat = CompletionFormat | ChatFormat


def chat_prompt_logprobs(
    prepared: PreparedRequest, choices: list[ChoiceState]
) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's top-level `prompt_logprobs` of a chat response: the choices share one prompt (the
    rendered template), so the first choice's entries stand for all."""
    scored = next((state.prompt_logprobs for state in choices if state.prompt_logprobs is not None), None)
    return _vllm_prompt_logprobs(prepared, scored)


def _echo_entries(
    prepared: PreparedRequest, echo: EchoedPrompt | None, prompt_logprobs: list[TokenLogprob | None] | None
) -> list[TokenLogprob | str]:
    """The echoed prompt's entries: its first token's text (it has no log-probability), then each
    token's entry cut to the `logprobs` alternatives the request asked for."""
    if echo is None or prompt_logprobs is None:
        return []
    top_n = prepared.echo_logprobs or 0
    entries: list[TokenLogprob | str] = [echo.first_token]
    for entry in prompt_logprobs[1:]:
        if entry is not None:
            entries.append(dataclasses.replace(entry, top=entry.top[:top_n]))
    return entries


def _completion_logprobs(entries: list[TokenLogprob | str], first_offset: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs; an entry that is only text (an echoed prompt's first token) has
    null logprobs."""
    offsets, offset = [], first_offset
    tokens: list[str] = []
    for entry in entries:
        token = entry if isinstance(entry, str) else entry.token
        offsets.append(offset)
        tokens.append(token)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if isinstance(entry, str) else entry.logprob for entry in entries],
        top_logprobs=[None if isinstance(entry, str) else _top_with_sampled(entry) for entry in entries],
        text_offset=offsets,
    )


def _top_with_sampled(entry: TokenLogprob) -> dict[str, float]:
    """The completions API's alternatives always hold the sampled token too (OpenAI and vLLM: up to
    `logprobs + 1` entries), so a client can read every token's logprob from one place."""
    top: dict[str, float] = {}
    for token, logprob in entry.top:  # best first: where two tokens read alike, the likelier one shows
        top.setdefault(token, logprob)
    top.setdefault(entry.token, entry.logprob)
    return top


def _vllm_prompt_logprobs(
    prepared: PreparedRequest, entries: list[TokenLogprob | None] | None
) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt position (the first null), the prompt's token and the
    `prompt_logprobs` most likely ones, keyed by token id, each with its rank and text."""
    if prepared.prompt_logprobs is None or entries is None:
        return None
    result: list[dict[str, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        position: dict[str, PromptLogprob] = {}
        top = list(zip(entry.top_ids, entry.top))[: prepared.prompt_logprobs]
        for rank, (token_id, (text, logprob)) in enumerate(top, start=1):
            position[str(token_id)] = PromptLogprob(logprob=logprob, rank=rank, decoded_token=text)
        position.setdefault(
            str(entry.token_id),
            PromptLogprob(logprob=entry.logprob, rank=entry.rank, decoded_token=entry.token),
        )
        result.append(position)
    return result


def chat_logprobs(entries: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=entry.token,
                logprob=entry.logprob,
                bytes=list(entry.token.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))
                    for token, logprob in entry.top
                ],
            )
            for entry in entries
        ]
    )
