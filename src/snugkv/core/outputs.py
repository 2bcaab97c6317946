"""What goes into the engine for one request and what comes back, step by step.

The scheduler builds these, the engine thread carries them across threads, the server and the
command-line tools turn them into responses. None of them knows about pools or the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from snugkv.core.sampling import SamplingParams

# "abort" (cut off before the model finished) reaches HTTP clients as "abort", as vLLM has it;
# "kv_capacity" (the KV cache cannot hold the next token) as OpenAI's "length" with the engine's
# reason in `finish_detail` (server/formats.py).
FinishReason = Literal["stop", "length", "abort", "kv_capacity", "error"]


@dataclass(frozen=True, slots=True)
class GenerateInput:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's entry in vLLM's shape: what `TokenLogprob[token_id]` gives."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprob(Mapping[int, Logprob]):
    """A token's log-probability; `top` holds the most likely alternatives (text, logprob) and
    `top_ids` their ids, best first; `rank` is the token's place among all (1: the most likely),
    where it was computed (prompt tokens).

    It is also vLLM's `{token_id: Logprob}` of its position (the token and its alternatives), so
    code written for vLLM reads `entry[token_id].logprob` or `entry.items()` unchanged."""

    token_id: int
    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)
    top_ids: tuple[int, ...] = ()
    rank: int | None = None

    def _entries(self) -> dict[int, Logprob]:
        entries = {
            token_id: Logprob(logprob, place, text)
            for place, (token_id, (text, logprob)) in enumerate(zip(self.top_ids, self.top), start=1)
        }
        entries.setdefault(self.token_id, Logprob(self.logprob, self.rank, self.token))
        return entries

    def __getitem__(self, token_id: int) -> Logprob:
        return self._entries()[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())


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
    error_param: str | None = None  # the request field a rejection is about (the 400's `param`)
    # the request waited for KV memory the engine could not get in time: a 503 with this Retry-After
    retry_after_s: float | None = None
    # speculative decoding, in a request's last output while it is on (None: off): draft tokens
    # the model judged for this request, and those it kept (OpenAI's usage reports them as
    # completion_tokens_details' accepted and rejected prediction tokens)
    draft_tokens: int | None = None
    accepted_draft_tokens: int = 0
