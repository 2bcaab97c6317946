"""The OpenAI response shapes of a generation: one JSON body, or chunk by chunk for SSE.

`ChoiceState` accumulates what one choice produced; `CompletionFormat` and `ChatFormat` turn engine
outputs and those states into the wire models of `protocol`. Pure functions of their inputs: no
I/O, no engine, no timing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel

from snugkv.core.outputs import GenerateOutput, TokenLogprob
from snugkv.server.prepare import PreparedRequest
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
    TopLogprob,
    UsageInfo,
)


@dataclass(slots=True)
class ChoiceState:
    """What one choice has produced so far."""

    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    counted_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    text_chars: int = 0
    latest_text_offset: int = 0  # where the text of the output absorbed last starts
    finish_reason: str | None = None  # OpenAI's value
    finish_detail: str | None = None  # the engine's own reason, where OpenAI's alone would mislead

    def absorb(self, output: GenerateOutput) -> None:
        self.text.append(output.text)
        self.latest_text_offset = self.text_chars
        self.text_chars += len(output.text)
        self.logprobs.extend(output.logprobs)
        self.counted_tokens += len(output.token_ids)
        self.completion_tokens = max(self.counted_tokens, output.completion_tokens)
        self.prompt_tokens = output.prompt_tokens or self.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, output.cached_tokens)
        if output.finished:
            self.finish_reason, self.finish_detail = openai_finish_reason(output.finish_reason)


def openai_finish_reason(engine_reason: str | None) -> tuple[str, str | None]:
    """OpenAI's `finish_reason` for the engine's, and the engine's own when it differs.

    The engine ends a request with "abort" when it is cut off before the model finished (the server
    is stopping, or the request was cancelled). OpenAI has no such value: strict clients reject the
    response and others treat it as an unknown kind of complete. "length" is the OpenAI value that
    says the text is cut short ("stop" would say the model finished its answer), so an aborted choice
    says "length" and keeps "abort" in `finish_detail`.
    """
    if engine_reason in (None, "stop", "length"):
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
    return UsageInfo(
        prompt_tokens=sum(prompt),
        completion_tokens=completion,
        total_tokens=sum(prompt) + completion,
        prompt_tokens_details={"cached_tokens": sum(cached)},
    )


class CompletionFormat:
    """Chunks and responses of POST /v1/completions."""

    # (server/sse.py) `delta` of an unfinished text-only output depends on its text alone, so the
    # server may write such chunks from a template: set False where a delta transforms its text.
    plain_text_deltas = True

    def opening(self, prepared: PreparedRequest) -> list[BaseModel]:
        return []

    def delta(
        self, prepared: PreparedRequest, index: int, output: GenerateOutput, state: ChoiceState
    ) -> BaseModel | None:
        logprobs = None
        if prepared.logprobs:
            logprobs = _completion_logprobs(output.logprobs, state.latest_text_offset)
        if not output.text and not output.finished and not output.logprobs:
            return None
        choice = CompletionChoice(
            index=index,
            text=output.text,
            logprobs=logprobs,
            finish_reason=state.finish_reason,
            finish_detail=state.finish_detail,
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
            choices=[
                CompletionChoice(
                    index=index,
                    text="".join(state.text),
                    logprobs=_completion_logprobs(state.logprobs, 0) if prepared.logprobs else None,
                    finish_reason=state.finish_reason,
                    finish_detail=state.finish_detail,
                )
                for index, state in enumerate(choices)
            ],
            usage=usage_of(prepared, choices),
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
        logprobs = _chat_logprobs(output.logprobs) if prepared.logprobs else None
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
                    logprobs=_chat_logprobs(state.logprobs) if prepared.logprobs else None,
                    finish_reason=state.finish_reason,
                    finish_detail=state.finish_detail,
                )
                for index, state in enumerate(choices)
            ],
            usage=usage_of(prepared, choices),
        )

    def _chunk(self, prepared: PreparedRequest, choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=prepared.request_id, created=prepared.created, model=prepared.model, choices=choices
        )


ResponseFormat = CompletionFormat | ChatFormat


def _completion_logprobs(entries: list[TokenLogprob], first_offset: int) -> CompletionLogprobs:
    offsets, offset = [], first_offset
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return CompletionLogprobs(
        tokens=[entry.token for entry in entries],
        token_logprobs=[entry.logprob for entry in entries],
        top_logprobs=[_top_with_sampled(entry) for entry in entries],
        text_offset=offsets,
    )


def _top_with_sampled(entry: TokenLogprob) -> dict[str, float]:
    """The completions API's alternatives always hold the sampled token too (OpenAI and vLLM: up to
    `logprobs + 1` entries), so a client can read every token's logprob from one place."""
    top = dict(entry.top)
    top.setdefault(entry.token, entry.logprob)
    return top


def _chat_logprobs(entries: list[TokenLogprob]) -> ChatLogprobs:
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
