"""The engine process's wire: every message the server's process and the engine process send each
other over their pipe (`engine_process`), as typed values. Each is a frozen dataclass, pickled as it
is; no message is a string-headed tuple or a dict.

Server -> engine (`ServerMessage`):
    LeaveTextDownstream  before any request: the server detokenizes the streams without stop strings
    Generate             a request (`GenerateInput`)
    AbortRequest         end one request
    AbortEveryRequest    end every request in flight (the server is stopping)
    Ask                  a `Call` under the id its reply comes back with
    StopEngine           finish the step, release the memory, exit

Engine -> server (`EngineMessage`):
    TokenizerSource      before the engine starts: where the tokenizer is (the server loads its copy)
    Ready                the engine started: its model's source, context, EOS ids, tokenizer source
    StartFailed          instead of `Ready`: the start-up error, raised in the server's process as itself
    TurnOutputs          one per turn: every output the turn produced
    CallAnswered         a call's value, under its id
    CallFailed           a call's error, under its id, raised in the server's process as itself

Calls (the `EngineThread` methods the server's routes reach across the pipe). Each is declared
here once: its fields are the method's arguments, `Call[R]` says the reply is an `R`, and `answer`
is what the engine process runs for it; `EngineProcess.call` sends any of them.
    ReadHealth -> bool          ReadSleeping -> bool        ReadServerInfo -> EngineInfo
    ReadMetrics -> MetricsSnapshot                          ReadRecentSteps -> list[StepRecord]
    ReadSleepState -> SleepState                            ReadKvInfo -> KvInfo
    ResizeKvCache -> KvResizeReply                          SleepEngine -> SleepReply
    WakeEngine -> SleepReply                                StartProfile -> str (the trace's folder)
    StopProfile -> ProfileReport

Errors cross as themselves (`crossing`): a `KvResizeError` or `ProfileError` keeps its status, a bad
model file is the same one-line error in the server's process; one that does not pickle becomes an
`EngineProcessError` naming its type, as does a call the engine process does not know. Values and the engine side of each
call only: nothing here reads or writes the pipe, and nothing here runs in the server's process
beyond building and reading messages.
"""

from __future__ import annotations

import pickle
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from snugkv.core.outputs import GenerateInput, GenerateOutput
from snugkv.core.profiles import ProfileReport
from snugkv.core.reports import EngineInfo, KvInfo, KvResizeReply, MetricsSnapshot, SleepReply, SleepState
from snugkv.driver.engine_thread import EngineThread
from snugkv.models.loader import ModelSource
from snugkv.scheduler.launched import StepRecord

ReplyT = TypeVar("ReplyT")


class EngineProcessError(RuntimeError):
    """The engine process is gone, did not answer, or was sent what it does not know; the message
    says which."""


# -- calls ------------------------------------------------------------------------------------
class Call(ABC, Generic[ReplyT]):
    """A call of the engine thread's, answered with a `ReplyT` (or raising what the engine raised).
    `answer` runs on the engine process's event loop: a read answers at once, a change waits for
    its turn on the scheduler thread."""

    __slots__ = ()

    @abstractmethod
    async def answer(self, engine: EngineThread) -> ReplyT: ...


@dataclass(frozen=True, slots=True)
class ReadHealth(Call[bool]):
    async def answer(self, engine: EngineThread) -> bool:
        return engine.check_health()


@dataclass(frozen=True, slots=True)
class ReadSleeping(Call[bool]):
    async def answer(self, engine: EngineThread) -> bool:
        return engine.is_sleeping()


@dataclass(frozen=True, slots=True)
class ReadServerInfo(Call[EngineInfo]):
    """The engine's `EngineInfo`; the server names its model and the engine process's pid in it."""

    async def answer(self, engine: EngineThread) -> EngineInfo:
        return engine.server_info()


@dataclass(frozen=True, slots=True)
class ReadMetrics(Call[MetricsSnapshot]):
    async def answer(self, engine: EngineThread) -> MetricsSnapshot:
        return engine.metrics_snapshot()


@dataclass(frozen=True, slots=True)
class ReadRecentSteps(Call[list[StepRecord]]):
    async def answer(self, engine: EngineThread) -> list[StepRecord]:
        return engine.recent_steps()


@dataclass(frozen=True, slots=True)
class ReadSleepState(Call[SleepState]):
    async def answer(self, engine: EngineThread) -> SleepState:
        return engine.sleep_state()


@dataclass(frozen=True, slots=True)
class ReadKvInfo(Call[KvInfo]):
    async def answer(self, engine: EngineThread) -> KvInfo:
        return await engine.kv_info()


@dataclass(frozen=True, slots=True)
class ResizeKvCache(Call[KvResizeReply]):
    """`EngineThread.resize_kv`: to a token count, or to what leaves `free_gib` free."""

    max_total_num_tokens: int | None = None
    free_gib: float | None = None

    async def answer(self, engine: EngineThread) -> KvResizeReply:
        return await engine.resize_kv(max_total_num_tokens=self.max_total_num_tokens, free_gib=self.free_gib)


@dataclass(frozen=True, slots=True)
class SleepEngine(Call[SleepReply]):
    level: int = 1
    tags: tuple[str, ...] = ()

    async def answer(self, engine: EngineThread) -> SleepReply:
        return await engine.sleep(level=self.level, tags=self.tags)


@dataclass(frozen=True, slots=True)
class WakeEngine(Call[SleepReply]):
    tags: tuple[str, ...] = ()

    async def answer(self, engine: EngineThread) -> SleepReply:
        return await engine.wake_up(tags=self.tags)


@dataclass(frozen=True, slots=True)
class StartProfile(Call[str]):
    output_dir: str | None = None
    num_steps: int | None = None

    async def answer(self, engine: EngineThread) -> str:
        return await engine.start_profile(output_dir=self.output_dir, num_steps=self.num_steps)


@dataclass(frozen=True, slots=True)
class StopProfile(Call[ProfileReport]):
    async def answer(self, engine: EngineThread) -> ProfileReport:
        return await engine.stop_profile()


# -- server -> engine -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LeaveTextDownstream:
    """Sent before any request: from now on the engine sends token ids only for the streams without
    stop strings, and the server detokenizes them (`server_text`)."""


@dataclass(frozen=True, slots=True)
class Generate:
    request: GenerateInput


@dataclass(frozen=True, slots=True)
class AbortRequest:
    rid: str


@dataclass(frozen=True, slots=True)
class AbortEveryRequest:
    """End every request in flight with finish_reason "abort" (the server is stopping)."""


@dataclass(frozen=True, slots=True)
class Ask:
    """`call`, whose reply comes back as a `CallAnswered` or `CallFailed` with this `call_id`."""

    call_id: int
    call: Call[Any]


@dataclass(frozen=True, slots=True)
class StopEngine:
    """The engine finishes its step, releases its memory and its process exits."""


ServerMessage = LeaveTextDownstream | Generate | AbortRequest | AbortEveryRequest | Ask | StopEngine


# -- engine -> server -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TokenizerSource:
    """Where the tokenizer is, sent before the engine starts so the server loads its copy meanwhile."""

    source: ModelSource


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine started and serves the pipe from now on."""

    source: ModelSource  # the model's files
    max_context_tokens: int  # tokens a prompt and its output may take together
    eos_token_ids: tuple[int, ...]
    tokenizer_source: ModelSource  # the tokenizer the server detokenizes with


@dataclass(frozen=True, slots=True)
class StartFailed:
    """Instead of `Ready`: what starting the engine raised (`crossing`), for the server to raise."""

    error: BaseException


@dataclass(frozen=True, slots=True)
class TurnOutputs:
    """Every output one turn produced, in one message. A plain output travels as a tuple (`compact`)."""

    outputs: list[GenerateOutput | tuple[Any, ...]]

    @classmethod
    def of(cls, outputs: list[GenerateOutput]) -> TurnOutputs:
        return cls([compact(output) for output in outputs])

    def expanded(self) -> list[GenerateOutput]:
        return [expand(item) for item in self.outputs]


@dataclass(frozen=True, slots=True)
class CallAnswered:
    call_id: int
    value: Any  # the reply type its `Call` declares


@dataclass(frozen=True, slots=True)
class CallFailed:
    call_id: int
    error: BaseException  # what the call raised (`crossing`)


EngineMessage = TokenizerSource | Ready | StartFailed | TurnOutputs | CallAnswered | CallFailed


def compact(output: GenerateOutput) -> GenerateOutput | tuple[Any, ...]:
    """A plain output (tokens and text, no logprobs or error) as a tuple: pickled in ~1/5 of the
    time of the dataclass (47 against 267 us for a step of 130 outputs on a CI CPU), on the
    scheduler thread of the engine process. `expand` turns it back."""
    if (
        output.logprobs
        or output.prompt_logprobs is not None
        or output.error is not None
        or output.rejected
        or output.draft_tokens is not None  # a last output under speculation: once per request
    ):  # retry_after_s comes with an error
        return output
    return (
        output.rid,
        output.token_ids,
        output.text,
        output.finished,
        output.finish_reason,
        output.prompt_tokens,
        output.completion_tokens,
        output.cached_tokens,
    )


def expand(item: GenerateOutput | tuple[Any, ...]) -> GenerateOutput:
    if isinstance(item, tuple):
        return GenerateOutput(*item)  # the fields in `compact`'s order
    return item


def crossing(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling (it is raised as itself on the other side), else an
    `EngineProcessError` with its type's name and message."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return EngineProcessError(f"{type(exc).__name__}: {exc}")
    return exc
