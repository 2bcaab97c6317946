"""The client side of `snugkv bench host-tier`: multi-turn chat sessions and a one-shot batch of
prompts, streamed to `/v1/completions` as token ids, each request timed and its outcome counted.

A session's turn re-sends the whole history (every earlier user turn and a stand-in for every
earlier answer) and a new user turn. The stand-in answer is the client's own tokens, not the
model's (the server gives text, not ids, and random weights give no useful text): the prefix cache
then serves each turn up to the end of the previous turn's prompt, and the answer and the new turn
are computed, as with a chat template that re-tokenizes the answer. Turns run from one FIFO queue
(a session's next turn joins its end when its turn is answered), so between two turns of a session
every other queued session has its turn: the working set is every session's history at once.

It never starts a server and never reads the server's counters (host_tier.py does both).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httpx

from snugkv.bench.harness import client_limits, percentile_ms
from snugkv.bench.openai_load import completion_body

TOKEN_LOW, TOKEN_HIGH = 100, 5000  # ids every shipped shape has (SmolLM2's vocabulary is 49,152)


@dataclass(frozen=True, slots=True)
class ChatShape:
    """`sessions` x `turns`; each turn adds `user_tokens` and asks for `output_tokens`, and the next
    turn's history holds as many stand-in answer tokens."""

    sessions: int
    turns: int
    user_tokens: int
    output_tokens: int

    @property
    def session_tokens(self) -> int:
        """A session's tokens after its last turn (its history, answers included)."""
        return self.turns * (self.user_tokens + self.output_tokens)

    @property
    def working_set_tokens(self) -> int:
        return self.sessions * self.session_tokens


def chat_shape(
    kv_tokens: int, sessions: int, turns: int, output_tokens: int, working_set: float
) -> ChatShape:
    """The turn size whose sessions together hold `working_set` times `kv_tokens` after their
    last turn (at least one user token a turn)."""
    per_turn = round(working_set * kv_tokens / (sessions * turns))
    return ChatShape(sessions, turns, max(1, per_turn - output_tokens), output_tokens)


def fitting_shape(chat: ChatShape, kv_tokens: int, share: float) -> ChatShape:
    """`chat`'s turns with as many sessions as hold `share` of `kv_tokens` together (at least one)."""
    sessions = max(1, int(share * kv_tokens // chat.session_tokens))
    return ChatShape(sessions, chat.turns, chat.user_tokens, chat.output_tokens)


def session_tokens(shape: ChatShape, session: int, salt: int = 0) -> list[int]:
    """Session `session`'s whole history after its last turn: user turn, stand-in answer, user turn,
    ... (`salt` makes another set of sessions). Turn t's prompt is its first `prompt_length(t)`."""
    rng = random.Random(f"{salt}-{session}")
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(shape.session_tokens)]


def prompt_length(shape: ChatShape, turn: int) -> int:
    """The earlier turns with their answers, then the new user turn."""
    return turn * (shape.user_tokens + shape.output_tokens) + shape.user_tokens


@dataclass
class LoadResult:
    """What the client saw: requests by outcome, output and prompt tokens, each request's time to
    its first chunk, the wall time, and whether the deadline cut the load short."""

    requests: int = 0
    failed: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    seconds: float = 0.0
    cut: bool = False
    errors: list[str] = field(default_factory=list)  # the first few

    def columns(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "failed": self.failed,
            "output_tok_per_s": self.output_tokens / self.seconds if self.seconds else 0.0,
            "median_ttft_ms": percentile_ms(self.ttft_s, 0.5),
            "p99_ttft_ms": percentile_ms(self.ttft_s, 0.99),
            "seconds": self.seconds,
            "cut": self.cut,
        }


class Client:
    """Streamed completions of token-id prompts against one server."""

    def __init__(self, url: str, concurrency: int) -> None:
        limits = client_limits(concurrency + 4)
        self.http = httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits)
        self.model = ""

    async def __aenter__(self) -> Client:
        self.model = (await self.http.get("/v1/models")).json()["data"][0]["id"]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def complete(self, prompt: list[int], max_tokens: int, result: LoadResult) -> None:
        """One streamed request; its outcome, tokens and first-chunk time go into `result`."""
        body = {"model": self.model, **completion_body(prompt, max_tokens)}
        started = time.monotonic()
        first: float | None = None
        tokens: int | None = None
        problem = ""
        result.requests += 1
        try:
            async with self.http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    problem = f"{response.status_code} {(await response.aread()).decode(errors='replace')}"
                else:
                    async for line in response.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[len("data: ") :])
                        if chunk.get("error"):
                            problem = json.dumps(chunk["error"])
                            break
                        if first is None and chunk.get("choices"):  # its text may be empty: no tokenizer
                            first = time.monotonic()
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
        except httpx.HTTPError as exc:
            problem = repr(exc)
        if not problem and tokens != max_tokens:
            problem = f"completion_tokens={tokens!r}, asked for {max_tokens}"
        if problem:
            result.failed += 1
            if len(result.errors) < 8:
                result.errors.append(problem[:300])
            return
        assert tokens is not None
        result.output_tokens += tokens
        result.prompt_tokens += len(prompt)
        if first is not None:
            result.ttft_s.append(first - started)


async def run_chat(
    url: str, shape: ChatShape, *, concurrency: int, deadline_s: float, salt: int = 0
) -> LoadResult:
    """Every session's turns, interleaved through one queue, `concurrency` requests at a time; no
    turn starts after `deadline_s` (those in flight finish; `cut` says so)."""
    queue = deque((session, 0) for session in range(shape.sessions))
    histories = [session_tokens(shape, session, salt) for session in range(shape.sessions)]
    result = LoadResult()
    async with Client(url, concurrency) as client:
        started = time.monotonic()

        async def worker() -> None:
            while queue:
                if time.monotonic() - started > deadline_s:
                    result.cut = True
                    return
                session, turn = queue.popleft()
                prompt = histories[session][: prompt_length(shape, turn)]
                await client.complete(prompt, shape.output_tokens, result)
                if turn + 1 < shape.turns:
                    queue.append((session, turn + 1))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.seconds = time.monotonic() - started
    return result


async def run_prompts(url: str, prompts: list[list[int]], max_tokens: int, *, concurrency: int) -> LoadResult:
    """Each prompt once, `concurrency` at a time."""
    pending = deque(prompts)
    result = LoadResult()
    async with Client(url, concurrency) as client:
        started = time.monotonic()

        async def worker() -> None:
            while pending:
                await client.complete(pending.popleft(), max_tokens, result)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.seconds = time.monotonic() - started
    return result
