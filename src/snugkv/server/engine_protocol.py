"""What the HTTP server needs from the engine, and nothing more.

The server validates and translates requests into `GenerateInput`s, then streams
`GenerateOutput`s back. It never touches pools, allocators or the model: the engine (the
scheduler thread and its runner) implements `EngineClient`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from snugkv.sampling_params import SamplingParams

# "abort" and "kv_capacity" (cut short because the KV cache cannot hold the next token) reach clients
# as OpenAI's "length" with the engine's reason in `finish_detail` (server/formats.py).
FinishReason = Literal["stop", "length", "abort", "kv_capacity", "error"]


@dataclass(frozen=True, slots=True)
class GenerateInput:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class GenerateOutput:
    """One step of a request's stream: the tokens and text added since the previous output."""

    rid: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    rejected: bool = False  # the engine refused the request as it is (a 400: `error` says what to change)


class EngineClient(Protocol):
    model_name: str
    max_context_tokens: int
    tokenizer: Any  # a transformers tokenizer with a chat template

    def generate(self, request: GenerateInput) -> AsyncIterator[GenerateOutput]:
        """Stream outputs for one request; cancelling the iterator aborts the request."""
        ...

    def abort(self, rid: str) -> None: ...

    def server_info(self) -> dict[str, Any]:
        """max_total_num_tokens, sizing mode, memory ledger, key arguments."""
        ...

    def check_health(self) -> bool: ...
