"""`snugkv bench http --url URL`: the serving workloads against any OpenAI-compatible server.

The server is one already running (snugkv, the smg router in front of replicas, vLLM, SGLang, ...);
nothing here starts or stops it, and only the OpenAI routes are used (`/v1/models`,
`/v1/completions`, `/v1/chat/completions`), so every server is measured by the same client:

- offline: `--requests` prompts with input and output lengths uniform in [`--low`, `--high`] tokens
  (the lengths of the built-in `bench http` workload, seed 0), all sent at once, streamed; after a
  warm-up and an untimed first pass of the same load with other text, as the built-in path does;
- rate: `--online-requests` prompts (lengths as `bench serving`'s online case) arriving as a Poisson
  process at each of `--request-rates`;
- chat: `--chat-users` users, each talking to one of `--chat-system-prompts` shared system prompts
  for `--chat-turns` turns (the history grows by each answer, as a chat client sends it),
  `--chat-concurrency` users at a time;
- stress (only when named): `--requests` prompts of `--stress-input-tokens` tokens, each asking for
  `--stress-output-tokens`, all sent at once after a warm-up of prompts that long; one measured pass
  per prompt kind (a server whose KV cache holds less than the demand queues and preempts).

Prompts are text by default (routers route on text and some refuse token ids): random words of the
prompt tokenizer (`--tokenizer`, else the server's model: the embedded SmolLM2 when it is served under
its own name, as by `serve` without --model, else its name read as a model path or Hub id), so a
prompt of N tokens is about N tokens for the server too (its own count, from `usage`, is in the
table). `--prompts ids,text` sends the offline and stress loads as token ids too (the same tokens'
ids, no tokenizer work in the server), one measured pass per kind, each row naming its `prompts`.
Outputs have fixed lengths (`ignore_eos`, a vLLM/SGLang/snugkv extension). Each row has the client's
figures: output tokens per second over the wall time, time to first token and per output token
(p50, p99), failed requests, and the share of prompt tokens the server reports cached
(`usage.prompt_tokens_details.cached_tokens`, where it does). When the server is snugkv, the share
of the run its device was idle comes from `/server_info` too, as in the built-in rows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from snugkv.bench.harness import client_limits, emit, latency_columns
from snugkv.bench.idle import step_figures
from snugkv.bench.serving import workload

logger = logging.getLogger(__name__)

WORKLOADS = ("offline", "rate", "chat", "stress")
DEFAULT_WORKLOADS = ("offline", "rate", "chat")  # stress only when asked for: it is long
PROMPT_KINDS = ("text", "ids")
WARM_UP_REQUESTS = 16
CLIENT_TIMEOUT_S = 3600.0
_WORD = re.compile(r"^ [A-Za-z]{2,}$")


class LoadTargetError(ValueError):
    """The server cannot be benchmarked as asked (the message says what to pass)."""


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    model: str
    headers: dict[str, str]


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request (seconds on the monotonic clock)."""

    sent_s: float
    first_token_s: float | None = None
    done_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None
    text: str = ""


# -- the server and its tokenizer ---------------------------------------------------------------
def resolve_target(url: str, model: str | None, api_key: str | None) -> Target:
    """The server at `url` and the model to ask for (`model`, else the first it lists)."""
    url = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{url}/v1/models", headers=headers, timeout=30.0)
    except httpx.HTTPError as exc:
        raise LoadTargetError(f"cannot reach {url}/v1/models ({exc}); check --url") from exc
    if response.status_code == 401:
        raise LoadTargetError(f"{url} wants an API key; pass --api-key (or set SNUGKV_API_KEY)")
    if response.status_code != 200:
        raise LoadTargetError(f"{url}/v1/models answered {response.status_code}; is --url an OpenAI API?")
    listed = [str(card["id"]) for card in response.json().get("data", [])]
    if model is None:
        if not listed:
            raise LoadTargetError(f"{url} lists no model; pass --model NAME")
        model = listed[0]
    elif listed and model not in listed:
        logger.warning("%s lists %s, not %s; sending --model as given", url, ", ".join(listed), model)
    return Target(url, model, headers)


def prompt_tokenizer(name: str | None, served_model: str) -> Any:
    """The tokenizer prompts are measured with: `name` ("default": the embedded SmolLM2's), else
    the served model's: the embedded one when the server calls it by its name (as `serve` without
    --model does), or its name read as a model path or Hub id."""
    from snugkv.models.default_model import DEFAULT_SERVED_NAME
    from snugkv.models.loader import ModelLoadError, resolve_model_source
    from snugkv.models.tokenizer import load_tokenizer

    wanted = name or ("default" if served_model == DEFAULT_SERVED_NAME else served_model)
    what_to_pass = "a model directory, a .gguf file or a Hub id ('default' for the embedded SmolLM2's)"
    try:
        return load_tokenizer(resolve_model_source(None if wanted == "default" else wanted))
    except ModelLoadError as exc:
        if name is None:
            raise LoadTargetError(
                f"cannot load the tokenizer of the model {served_model!r} (no model directory or Hub id "
                f"here); pass --tokenizer with {what_to_pass}"
            ) from exc
        raise LoadTargetError(f"--tokenizer {name!r} is no model here; pass {what_to_pass}") from exc
    except Exception as exc:  # any other loader's refusal (a download, a broken file): the same flag
        raise LoadTargetError(
            f"cannot load a tokenizer for {wanted!r} ({type(exc).__name__}: {_one_line(exc)}); pass "
            f"--tokenizer: {what_to_pass}"
        ) from exc


Prompt = str | list[int]  # text, or token ids


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


class PromptText:
    """Random text of a given token count, made of the tokenizer's own whole-word tokens, so that
    encoding it gives back about that many tokens; or the ids of such tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        vocab = len(tokenizer.hf)
        pieces = tokenizer.hf.batch_decode([[index] for index in range(vocab)])
        self.word_ids = [index for index, piece in enumerate(pieces) if _WORD.match(piece)]
        if len(self.word_ids) < 100:  # a tokenizer without space-led words: any ids will do
            self.word_ids = list(range(min(vocab, 1000), vocab))

    def text(self, tokens: int, rng: random.Random) -> str:
        ids = [rng.choice(self.word_ids) for _ in range(tokens)]
        text = str(self.tokenizer.decode(ids))
        encoded = self.tokenizer.encode(text, add_special_tokens=False)
        return text if len(encoded) <= tokens else str(self.tokenizer.decode(encoded[:tokens]))

    def ids(self, tokens: int, rng: random.Random) -> list[int]:
        return [rng.choice(self.word_ids) for _ in range(tokens)]

    def prompt(self, kind: str, tokens: int, rng: random.Random) -> Prompt:
        """A prompt of `kind` ("text" or "ids") of `tokens` tokens."""
        return self.ids(tokens, rng) if kind == "ids" else self.text(tokens, rng)


# -- one request --------------------------------------------------------------------------------
# The client reads a completion stream as bytes, not as events: parsing every chunk would make the
# client, not the server, what a busy machine measures. The first text and the usage are enough.
_TEXT = re.compile(rb'"(?:text|content)": ?"[^"]')
_USAGE = re.compile(rb'"usage": ?\{')
_ERROR = re.compile(rb'data: ?\{"error"')
_TAIL_BYTES = 16384


def encoded(target: Target, body: dict[str, Any]) -> bytes:
    """A request's JSON, encoded before the clock starts (the client's work, not the server's)."""
    return json.dumps({**body, "model": target.model}).encode()


async def send(
    client: httpx.AsyncClient, target: Target, path: str, body: bytes, *, keep_text: bool = False
) -> RequestRecord:
    """POST one streamed request (`encoded` JSON); the record of what came back (an error is
    recorded, not raised). `keep_text` parses every event to keep the answer (a chat's next turn
    sends it back)."""
    record = RequestRecord(sent_s=time.monotonic())
    pieces: list[str] = []
    tail = b""
    headers = {**target.headers, "content-type": "application/json"}
    try:
        async with client.stream("POST", path, content=body, headers=headers) as r:
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"
                return record
            async for chunk in r.aiter_bytes():
                if record.first_token_s is None and _TEXT.search(chunk):
                    record.first_token_s = time.monotonic()
                if _ERROR.search(tail[-16:] + chunk):  # an event may span two chunks
                    record.error = "stream error: " + chunk[:200].decode(errors="replace")
                tail = (tail + chunk)[-_TAIL_BYTES:] if not keep_text else tail + chunk
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        record.done_s = time.monotonic()
    events = [event[len(b"data: ") :] for event in tail.split(b"\n\n") if event.startswith(b"data: {")]
    if keep_text:
        for event in events:
            for choice in json.loads(event).get("choices") or []:
                pieces.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
        record.text = "".join(pieces)
    usage_events = [event for event in events if _USAGE.search(event)]
    if usage_events:
        usage = json.loads(usage_events[-1])["usage"]
        record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        record.completion_tokens = int(usage.get("completion_tokens") or 0)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        record.cached_tokens = int(cached) if cached is not None else None
    if record.error is None and not record.completion_tokens:
        record.error = "the stream ended without usage (is stream_options.include_usage supported?)"
    return record


def completion_body(prompt: Prompt, max_tokens: int) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def chat_body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


POOL_SIZE = 16  # connections of one client pool (`_pool_sizes`)


def _client(connections: int) -> httpx.AsyncClient:
    limits = client_limits(connections + 8)
    return httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, limits=limits)


# -- workloads ----------------------------------------------------------------------------------
async def run_completions(
    target: Target, prompts: list[tuple[Prompt, int]], arrivals: list[float] | None = None
) -> tuple[list[RequestRecord], float, float]:
    """Every prompt at once (or each at its arrival time, seconds after the start)."""
    # The bodies first: encoding 256 long prompts can outlast the pool's keep-alive (CLIENT_KEEPALIVE_S),
    # and a pool warmed before them would open every connection again inside the timed window.
    bodies = [encoded(target, completion_body(prompt, max_tokens)) for prompt, max_tokens in prompts]
    async with contextlib.AsyncExitStack() as stack:
        sizes = _pool_sizes(len(prompts))
        clients = [await stack.enter_async_context(_client(size)) for size in sizes]
        for client in clients:
            client.base_url = httpx.URL(target.url)
        # A load generator's pools are warm: connections open before the clock starts.
        await asyncio.gather(
            *(
                client.get("/v1/models", headers=target.headers)
                for client, size in zip(clients, sizes)
                for _ in range(size)
            )
        )
        started = time.monotonic()

        async def one(index: int, body: bytes) -> RequestRecord:
            if arrivals is not None:
                await asyncio.sleep(max(0.0, started + arrivals[index] - time.monotonic()))
            return await send(clients[index % len(clients)], target, "/v1/completions", body)

        records = await asyncio.gather(*(one(index, body) for index, body in enumerate(bodies)))
        return list(records), started, time.monotonic()


def _pool_sizes(connections: int) -> list[int]:
    """Connections split over pools of at most POOL_SIZE: an httpx pool's bookkeeping for each
    request walks all its connections and queued requests, so 256 streams in one pool took ~1.9 s
    (on a 2-core CPU and on the H100 machines alike) before the first request left the client."""
    pools = max(1, -(-connections // POOL_SIZE))
    return [-(-connections // pools)] * pools


@dataclass(frozen=True, slots=True)
class ChatSession:
    system: str
    turns: list[str]


def chat_sessions(
    text: PromptText,
    *,
    system_prompts: int,
    users: int,
    turns: int,
    system_tokens: int,
    turn_tokens: int,
    seed: int,
) -> list[ChatSession]:
    """`users` conversations of `turns` user messages, each under one of `system_prompts` shared
    system prompts (chosen at random per user, seeded)."""
    rng = random.Random(seed)
    systems = [f"You are assistant {k}. " + text.text(system_tokens, rng) for k in range(system_prompts)]
    return [
        ChatSession(rng.choice(systems), [text.text(turn_tokens, rng) for _ in range(turns)])
        for _ in range(users)
    ]


async def run_chat(
    target: Target, sessions: list[ChatSession], answer_tokens: int, concurrency: int
) -> tuple[list[RequestRecord], float, float]:
    """Each session's turns one after another (the answer joins the history), `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)
    async with _client(concurrency) as client:
        client.base_url = httpx.URL(target.url)
        await asyncio.gather(*(client.get("/v1/models", headers=target.headers) for _ in range(concurrency)))
        started = time.monotonic()

        async def talk(session: ChatSession) -> list[RequestRecord]:
            records = []
            async with gate:
                messages = [{"role": "system", "content": session.system}]
                for turn in session.turns:
                    messages.append({"role": "user", "content": turn})
                    body = encoded(target, chat_body(messages, answer_tokens))
                    record = await send(client, target, "/v1/chat/completions", body, keep_text=True)
                    records.append(record)
                    if record.error is not None:
                        break  # the rest of this conversation has no history to go on
                    messages.append({"role": "assistant", "content": record.text})
            return records

        per_session = await asyncio.gather(*(talk(session) for session in sessions))
        return [record for records in per_session for record in records], started, time.monotonic()


def summarize(records: list[RequestRecord], started_s: float, ended_s: float) -> dict[str, Any]:
    """The row figures of one workload's records."""
    done = [record for record in records if record.error is None]
    seconds = ended_s - started_s
    output_tokens = sum(record.completion_tokens for record in done)
    ttft = [r.first_token_s - r.sent_s for r in done if r.first_token_s is not None]
    tpot = [
        (r.done_s - r.first_token_s) / (r.completion_tokens - 1)
        for r in done
        if r.first_token_s is not None and r.completion_tokens > 1
    ]
    prompt_tokens = sum(record.prompt_tokens for record in done)
    reported = [record.cached_tokens for record in done if record.cached_tokens is not None]
    row: dict[str, Any] = {
        "requests": len(records),
        "errors": len(records) - len(done),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "seconds": seconds,
        "output_tok_per_s": output_tokens / seconds if seconds > 0 else float("nan"),
        **latency_columns(ttft, tpot),
        "cached_prompt_fraction": sum(reported) / prompt_tokens if reported and prompt_tokens else None,
    }
    errors = [record.error for record in records if record.error is not None]
    if errors:
        row["first_error"] = errors[0]
    return row


def _server_info(target: Target, steps: bool = False) -> dict[str, Any]:
    """snugkv's `/server_info` (with `?steps=true` its recent steps), {} from any other server."""
    try:
        response = httpx.get(
            f"{target.url}/server_info",
            headers=target.headers,
            params={"steps": "true"} if steps else None,
            timeout=10.0,
        )
        info = response.json() if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}
    return info if isinstance(info, dict) and isinstance(info.get("step_times"), dict) else {}


def _measured(target: Target, coroutine: Any) -> dict[str, Any]:
    """Run a pass and summarize it; against snugkv, with the share of the pass the GPU sat idle and
    where (before the first step, between steps, before prefill steps: `bench.idle.step_figures`
    over the steps the server launched within the pass; one monotonic clock on one machine)."""
    before = _server_info(target).get("step_times", {})
    records, started, ended = asyncio.run(coroutine)
    row = summarize(records, started, ended)
    info = _server_info(target, steps=True)
    after = info.get("step_times", {})
    busy_before, busy_after = before.get("device_busy_s"), after.get("device_busy_s")
    if isinstance(busy_before, int | float) and isinstance(busy_after, int | float) and row["seconds"] > 0:
        row["gpu_idle_fraction"] = max(0.0, 1 - (busy_after - busy_before) / row["seconds"])
        row.update(step_figures(info.get("recent_steps", []), started, ended))
    return row


# -- the command --------------------------------------------------------------------------------
def run_against_url(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    if args.stub_step_ms is not None:
        print("error: --url drives a server that is already running; drop --stub-step-ms", file=sys.stderr)
        return 2
    api_key = args.api_key if args.api_key is not None else os.environ.get("SNUGKV_API_KEY")
    try:
        target = resolve_target(args.url, args.model, api_key)
        text = PromptText(prompt_tokenizer(args.tokenizer, target.model))
    except LoadTargetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    offline = workload(args.requests, seed=0, vocab=500, low=args.low, high=args.high)
    # Fresh text on every run (unless --prompt-seed): a server's prefix cache holds nothing of it.
    rng = random.Random(args.prompt_seed)
    if "offline" in args.workloads:
        warm_up = [(text.prompt(args.prompts[0], 60, rng), 64) for _ in range(args.warm_up_requests)]
        asyncio.run(run_completions(target, warm_up))
        case = f"offline {args.requests} req, in/out U[{args.low},{args.high}]"
        passes = [("first pass, not compared", args.prompts[0])]
        passes += [("measured", kind) for kind in args.prompts]
        for name, kind in passes:
            # fresh prompts each pass
            prompts = [(text.prompt(kind, len(prompt), rng), out) for prompt, out in offline]
            row = _measured(target, run_completions(target, prompts))
            path = f"{args.url}, httpx client, streamed ({name})"
            rows.append({"path": path, "case": case, "prompts": kind, **row})
    if "rate" in args.workloads:
        for rate in args.request_rates:
            online = workload(
                args.online_requests, seed=int(rate * 10), vocab=500, low=args.low, high=args.high
            )
            arrival_rng, clock, arrivals = random.Random(int(rate)), 0.0, []
            for _ in online:
                clock += arrival_rng.expovariate(rate)
                arrivals.append(clock)
            prompts = [(text.text(len(prompt), rng), out) for prompt, out in online]
            row = _measured(target, run_completions(target, prompts, arrivals))
            case = f"online Poisson {rate} req/s, {args.online_requests} req"
            rows.append({"path": f"{args.url}, httpx client, streamed", "case": case, **row})
    if "chat" in args.workloads:
        sessions = chat_sessions(
            text,
            system_prompts=args.chat_system_prompts,
            users=args.chat_users,
            turns=args.chat_turns,
            system_tokens=args.chat_system_tokens,
            turn_tokens=args.chat_turn_tokens,
            seed=rng.randrange(1 << 30),
        )
        row = _measured(target, run_chat(target, sessions, args.chat_answer_tokens, args.chat_concurrency))
        case = (
            f"chat {args.chat_users} users x {args.chat_turns} turns, {args.chat_system_prompts} shared "
            f"system prompts of {args.chat_system_tokens} tokens, {args.chat_concurrency} at a time"
        )
        rows.append({"path": f"{args.url}, httpx client, streamed", "case": case, **row})
    if "stress" in args.workloads:
        rows.extend(_stress_rows(args, target, text, rng))
    emit("http", rows, args.out, extra={"url": args.url, "model": target.model})
    return 1 if any(row["errors"] for row in rows) else 0


def _stress_rows(
    args: argparse.Namespace, target: Target, text: PromptText, rng: random.Random
) -> list[dict[str, Any]]:
    """The stress load once per prompt kind, after a warm-up whose prefills are as long as its own."""
    inputs, outputs = args.stress_input_tokens, args.stress_output_tokens
    warm_up = [(text.prompt(args.prompts[0], inputs, rng), 16) for _ in range(args.warm_up_requests)]
    asyncio.run(run_completions(target, warm_up))
    case = f"stress {args.requests} x ({inputs} in + {outputs} out)"
    rows = []
    for kind in args.prompts:
        prompts: list[tuple[Prompt, int]] = [
            (text.prompt(kind, inputs, rng), outputs) for _ in range(args.requests)
        ]
        row = _measured(target, run_completions(target, prompts))
        rows.append({"path": f"{args.url}, httpx client, streamed", "case": case, "prompts": kind, **row})
    return rows


def add_url_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("against a running server (--url)")
    group.add_argument(
        "--url",
        default=None,
        help="benchmark this OpenAI-compatible server (e.g. http://127.0.0.1:8000) instead of starting one",
    )
    group.add_argument("--api-key", default=None, help="--url: the server's key (default: $SNUGKV_API_KEY)")
    group.add_argument(
        "--workloads",
        type=_workloads,
        default=list(DEFAULT_WORKLOADS),
        help=f"--url: which workloads run, of {','.join(WORKLOADS)} (default: {','.join(DEFAULT_WORKLOADS)})",
    )
    group.add_argument(
        "--prompts",
        type=_prompt_kinds,
        default=["text"],
        help="--url offline and stress: the prompt kinds, one measured pass each, of text,ids (default: text)",
    )
    group.add_argument(
        "--stress-input-tokens", type=int, default=3500, help="--url stress: each prompt's length"
    )
    group.add_argument(
        "--stress-output-tokens", type=int, default=400, help="--url stress: each request's output"
    )
    group.add_argument(
        "--prompt-seed", type=int, default=None, help="--url: seed of the prompts' text (default: a new one)"
    )
    group.add_argument(
        "--warm-up-requests",
        type=int,
        default=WARM_UP_REQUESTS,
        help=f"--url offline and stress: requests of the warm-up before the passes (default: {WARM_UP_REQUESTS})",
    )
    group.add_argument("--online-requests", type=int, default=128, help="--url rate: requests per rate")
    group.add_argument(
        "--request-rates", type=float, nargs="+", default=[8.0, 32.0], help="--url rate: requests/s"
    )
    group.add_argument("--chat-system-prompts", type=int, default=8, help="--url chat: shared system prompts")
    group.add_argument("--chat-users", type=int, default=32, help="--url chat: conversations")
    group.add_argument("--chat-turns", type=int, default=3, help="--url chat: user turns per conversation")
    group.add_argument("--chat-system-tokens", type=int, default=512, help="--url chat: system prompt length")
    group.add_argument("--chat-turn-tokens", type=int, default=64, help="--url chat: user message length")
    group.add_argument("--chat-answer-tokens", type=int, default=64, help="--url chat: answer length")
    group.add_argument("--chat-concurrency", type=int, default=8, help="--url chat: users talking at once")


def _names(value: str, known: tuple[str, ...], what: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{value!r}: name {what} from {', '.join(known)}, separated by commas"
        )
    return names


def _workloads(value: str) -> list[str]:
    return _names(value, WORKLOADS, "workloads")


def _prompt_kinds(value: str) -> list[str]:
    return _names(value, PROMPT_KINDS, "prompt kinds")
