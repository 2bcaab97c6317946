"""The soak's requests: one function per kind, each answering how the request ended.

Every kind goes to an OpenAI route of the server with a short output (the soak is about what the
server keeps or loses over time, not about throughput). How a request ended is one of
`OUTCOMES`: the status class of the answer, or `client-cut` for the kinds that end the request
themselves, after two events or half a second (`disconnect`: the socket is reset mid-stream,
without closing the HTTP exchange; `abort`: the stream is closed, as a client that stops reading
does). A streamed answer whose events carry an error counts as a 5xx: its status line said 200
before the failure. The kinds that need the server's tokenizer (text in, text out) are `TEXT_KINDS`; a server
without one gets token-id prompts and only the other kinds.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

TEXT_KINDS = frozenset({"chat", "chat_stream", "scoring", "structured"})
OUTCOMES = ("200", "4xx", "5xx", "client-cut", "client-error")
MAX_TOKENS = 16
# A `disconnect` or an `abort` ends its request after this many data events, or this long after
# sending it, whichever comes first: a server without a tokenizer streams no text, so it may send
# no event before the last. Its output is long enough to be cut mid-answer.
CUT_AFTER_EVENTS = 2
CUT_AFTER_S = 0.5
CUT_MAX_TOKENS = 128
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 16}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
# fmt: off
_WORDS = [
    "river", "stone", "lantern", "harbor", "maple", "quiet", "orbit", "velvet", "signal", "meadow",
    "copper", "thunder", "garden", "silver", "cabin", "winter", "echo", "marble", "forest", "candle",
]
# fmt: on


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one request (or control call) of `kind` ended, when it started and how long it took."""

    kind: str
    outcome: str  # one of OUTCOMES
    started_s: float  # on the monotonic clock
    latency_s: float
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Target:
    """The server under soak: its base URL, the model it serves, and whether it has a tokenizer."""

    url: str
    model: str
    has_tokenizer: bool
    vocab_size: int = 1000  # token-id prompts stay below it

    def prompt(self, rng: random.Random) -> str | list[int]:
        if self.has_tokenizer:
            return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 24)))
        return [rng.randrange(10, self.vocab_size) for _ in range(rng.randint(4, 24))]


def status_class(code: int) -> str:
    """An HTTP status as an outcome: 200, 4xx, 5xx (anything else, e.g. 0 for no answer: client-error)."""
    return "200" if code == 200 else "4xx" if 400 <= code < 500 else "5xx" if code >= 500 else "client-error"


def _error_text(events: list[dict[str, Any]]) -> str:
    """The first error a stream carried, or ''."""
    for event in events:
        if "error" in event:
            return json.dumps(event["error"])[:300]
    return ""


def _events(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


RequestFn = Callable[[httpx.AsyncClient, Target, random.Random], Awaitable[tuple[str, str]]]


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[str, str]:
    response = await client.post(path, json=body)
    detail = "" if response.status_code == 200 else response.text[:300]
    return status_class(response.status_code), detail


async def _stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], cut: bool = False
) -> tuple[str, str]:
    """A streamed request read to its end, or closed mid-answer (`cut`, see `CUT_AFTER_S`)."""
    lines: list[str] = []
    try:
        async with asyncio.timeout(CUT_AFTER_S if cut else None):
            async with client.stream("POST", path, json={**body, "stream": True}) as response:
                if response.status_code != 200:
                    return status_class(response.status_code), (await response.aread()).decode()[:300]
                async for line in response.aiter_lines():
                    lines.append(line)
                    if cut and len(_events(lines)) >= CUT_AFTER_EVENTS:
                        return "client-cut", ""  # leaving the block closes the stream mid-answer
    except TimeoutError:
        return "client-cut", f"cut after {CUT_AFTER_S} s, {len(_events(lines))} events"
    error = _error_text(_events(lines))
    if error:
        return "5xx", f"error event in a 200 stream: {error}"
    if "data: [DONE]" not in (line.strip() for line in lines):
        return "5xx", "the stream ended without data: [DONE]"
    if cut:
        return "200", "the stream ended before the cut"
    return "200", ""


def _completion(target: Target, rng: random.Random, **extra: Any) -> dict[str, Any]:
    return {"model": target.model, "prompt": target.prompt(rng), "max_tokens": MAX_TOKENS, **extra}


def _chat(target: Target, rng: random.Random, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": str(target.prompt(rng))}]
    return {"model": target.model, "messages": messages, "max_tokens": MAX_TOKENS, **extra}


async def completion(client: httpx.AsyncClient, target: Target, rng: random.Random) -> tuple[str, str]:
    return await _post(client, "/v1/completions", _completion(target, rng, temperature=0.0))


async def completion_stream(client: httpx.AsyncClient, target: Target, rng: random.Random) -> tuple[str, str]:
    return await _stream(client, "/v1/completions", _completion(target, rng, temperature=0.7))


async def chat(client: httpx.AsyncClient, target: Target, rng: random.Random) -> tuple[str, str]:
    return await _post(client, "/v1/chat/completions", _chat(target, rng, temperature=0.0))


async def chat_stream(client: httpx.AsyncClient, target: Target, rng: random.Random) -> tuple[str, str]:
    return await _stream(client, "/v1/chat/completions", _chat(target, rng, temperature=0.7))


async def n_best(client: httpx.AsyncClient, target: Target, rng: random.Random) -> tuple[str, str]:
    body = _completion(target, rng, n=3, temperature=0.9, seed=rng.randrange(1 << 30))
    return await _post(client, "/v1/completions", body)


async def penalties(client: httpx.AsyncClient, target: Target, rng: random.Random) -> tuple[str, str]:
    body = _completion(
        target, rng, temperature=0.8, presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.2
    )
    return await _post(client, "/v1/completions", body)


async def scoring(client: httpx.AsyncClient, target: Target, rng: random.Random) -> tuple[str, str]:
    body = _completion(target, rng, max_tokens=0, echo=True, logprobs=1, temperature=0.0)
    return await _post(client, "/v1/completions", body)


async def structured(client: httpx.AsyncClient, target: Target, rng: random.Random) -> tuple[str, str]:
    schema = {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}
    body = _chat(target, rng, max_tokens=48, response_format={"type": "json_schema", "json_schema": schema})
    return await _post(client, "/v1/chat/completions", body)


async def abort(client: httpx.AsyncClient, target: Target, rng: random.Random) -> tuple[str, str]:
    body = _completion(target, rng, max_tokens=CUT_MAX_TOKENS, ignore_eos=True)
    return await _stream(client, "/v1/completions", body, cut=True)


async def disconnect(client: httpx.AsyncClient, target: Target, rng: random.Random) -> tuple[str, str]:
    """A raw HTTP/1.1 stream whose socket is dropped (no close of the exchange) after a few events."""
    address = urlsplit(target.url)
    body = json.dumps(_completion(target, rng, max_tokens=CUT_MAX_TOKENS, ignore_eos=True, stream=True))
    reader, writer = await asyncio.open_connection(address.hostname, address.port or 80)
    try:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {address.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body.encode())}\r\n"
        )
        for name, value in client.headers.items():
            if name.lower() == "authorization":
                head += f"{name}: {value}\r\n"
        writer.write((head + "\r\n" + body).encode())
        await writer.drain()
        try:
            async with asyncio.timeout(CUT_AFTER_S):
                status_line = await reader.readline()
                code = int(status_line.split()[1]) if len(status_line.split()) > 1 else 0
                if code != 200:
                    return status_class(code), status_line.decode(errors="replace").strip()
                seen = 0
                while seen < CUT_AFTER_EVENTS:
                    line = await reader.readline()
                    if not line:
                        return "200", "the stream ended before the cut"
                    seen += line.startswith(b"data: {")
        except TimeoutError:
            pass  # cut on time: no events yet (a server without a tokenizer streams no text)
        return "client-cut", ""
    finally:
        writer.transport.abort()  # a reset, not a FIN after a finished exchange


REQUESTS: dict[str, RequestFn] = {
    "completion": completion,
    "completion_stream": completion_stream,
    "chat": chat,
    "chat_stream": chat_stream,
    "n_best": n_best,
    "penalties": penalties,
    "scoring": scoring,
    "structured": structured,
    "disconnect": disconnect,
    "abort": abort,
}
KINDS = tuple(REQUESTS)


async def send(client: httpx.AsyncClient, target: Target, kind: str, rng: random.Random) -> Outcome:
    """One request of `kind`; a transport failure is a `client-error` (the server may have died)."""
    started = time.monotonic()
    try:
        outcome, detail = await REQUESTS[kind](client, target, rng)
    except (httpx.HTTPError, OSError, asyncio.IncompleteReadError) as exc:
        outcome, detail = "client-error", f"{type(exc).__name__}: {exc}"[:300]
    return Outcome(kind, outcome, started, time.monotonic() - started, detail)
