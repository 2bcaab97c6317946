"""What goes into the engine for one request and what comes back, step by step.

The scheduler builds these, the engine thread carries them across threads, the server and the
command-line tools turn them into responses. None of them knows about pools or the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from snugkv.core.sampling import SamplingParams

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
    """A token's log-probability; `top` holds the most likely alternatives (text, logprob) and
    `top_ids` their ids, best first; `rank` is the token's place among all (1: the most likely),
    where it was computed (prompt tokens)."""

    token_id: int
    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)
    top_ids: tuple[int, ...] = ()
    rank: int | None = None


@dataclass(slots=True)
class GenerateOutput:
    """One step of a request's stream: the tokens and text added since the previous output.
    Not frozen: one is built per request per step, and a frozen `__init__` costs twice as much."""

    rid: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # one entry per prompt token (the first is None: nothing comes before it), once, in the first
    # output after the prompt is scored; None when the request did not ask (`prompt_logprobs`)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None
    rejected: bool = False  # the engine refused the request as it is (a 400: `error` says what to change)
