"""The process driver: the engine core in a process of its own (`snugkv serve`'s default).

In one process the server's event loop and the scheduler thread share one GIL: while the loop
parses requests and writes chunks, the scheduler cannot queue the next step and the GPU waits
(bench http, Qwen3-0.6B shape on the H200: 0.81-0.87x the in-process tok/s, docs/bench/http.md).
Here the engine core and its `EngineThread` (the scheduler thread) run in a child process started with
`spawn`; the server's process keeps the tokenizer and talks to it over a pipe:

- server -> engine: "leave the text downstream" (the server holds the tokenizer and detokenizes), a
  request (`GenerateInput`), an abort, "abort every request", a `Call` of the engine thread's (the
  elastic, sleep and info routes), "stop";
- engine -> server: the model's source (so the server loads its tokenizer while the engine starts),
  `Ready` (or the start-up error itself, re-raised in the server's process, so a bad model file is
  the same one-line error as without this flag), one message per turn with every output the turn
  produced, the replies to calls.

Every message is a typed value of `wire`, which lists them; a call is declared there once and sent
with `EngineProcess.call` (the `EngineClient` methods are one line each).

Text (`server_text`): the server detokenizes every stream without stop strings, on its reader
thread, one batched decode per turn; the engine's scheduler thread sends their token ids only.

In the engine process a writer thread pickles and sends every message, in order: the scheduler
thread only queues a turn's outputs (outputs queued while a send is under way go out as one
message), so it never waits on a pipe whose server side has not been read yet. With the scheduler
sending itself, a stub-device engine (bench http, 256 streams) spent 12-14% of its scheduler
thread's samples blocked in the pipe's write (py-spy, CPU at e86cb6c).

A reader thread in the server's process unpickles each message and hands a turn's outputs to the
event loop in one `Mailbox` post, as the scheduler thread does in one process. The engine process
ignores SIGINT and SIGTERM: the server owns shutdown (it finishes in-flight requests, then sends
`StopEngine`); it exits by itself when the server's end of the pipe closes. If it dies, every open
request ends with an error, /health answers 503 and `on_exit` is called.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import pickle
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from snugkv.core.gc_pauses import freeze_startup_objects
from snugkv.core.outputs import GenerateInput, GenerateOutput
from snugkv.core.profiles import ProfileReport
from snugkv.core.reports import EngineInfo, KvInfo, KvResizeReply, MetricsSnapshot, SleepReply, SleepState
from snugkv.driver import wire
from snugkv.driver.engine_core import EngineCore
from snugkv.driver.engine_start import LogSettings, StartedEngine, ignore_stop_signals, spawn
from snugkv.driver.engine_thread import (
    EngineThread,
    Mailbox,
    OutputStream,
    error_output,
    id_in_use_output,
    loop_mailbox,
    stream_until_finished,
)
from snugkv.driver.server_text import StreamTexts, TokenizerLoad
from snugkv.driver.wire import EngineProcessError
from snugkv.engine import Engine, EngineArgs
from snugkv.models.loader import ModelSource, resolve_model_source
from snugkv.scheduler.launched import StepRecord

logger = logging.getLogger(__name__)

ReplyT = TypeVar("ReplyT")

SYNC_CALL_TIMEOUT_S = 30.0  # a synchronous read (server_info, ...) waits at most this for the engine
HEALTH_CALL_TIMEOUT_S = 5.0  # /health answers 503 sooner than a read gives up
STOP_TIMEOUT_S = 120.0  # the engine finishes its step and releases its memory in this time, or is killed


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process builds: the engine core, then the thread that drives it."""

    engine_args: EngineArgs
    # Run on the engine right after it is built, in the engine process (a benchmark's stub device);
    # picklable: a module-level function or a bound method of a picklable object.
    after_start: Callable[[Engine], None] | None = None
    # Detokenize with this model's tokenizer (a `ModelSource`) instead of the engine's model's own.
    tokenizer_source: ModelSource | None = None
    log: LogSettings = field(default_factory=LogSettings)  # the server's (`LogSettings.of_root()`)


class EngineProcess:
    """The server's side: an `EngineClient` (the generation, elastic and info calls of `EngineThread`)
    whose engine runs in a child process. Blocks in `__init__` until the engine is ready; a start-up
    error is raised here as the engine raised it."""

    def __init__(
        self, spec: EngineSpec | StartedEngine, *, on_exit: Callable[[str], None] | None = None
    ) -> None:
        """Spawn the engine process for `spec`, or take over one already spawned (`engine_start`)."""
        started = spec if isinstance(spec, StartedEngine) else spawn(engine_main, spec)
        started.adopted = True
        self._conn, self._process = started.conn, started.process
        self._send_lock = threading.Lock()
        self._streams: dict[str, tuple[Mailbox, OutputStream]] = {}
        self._streams_lock = threading.Lock()
        self._mailboxes: dict[asyncio.AbstractEventLoop, Mailbox] = {}
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._gone: str | None = None  # why the engine process cannot serve any more
        self._stopping = False
        self._sleeping: bool | None = None  # None: not known here yet (`is_sleeping` asks once)
        self.died: str | None = None  # why the engine process ended unasked, if it did
        self._on_exit = on_exit
        tokenizer_load = TokenizerLoad()
        try:
            ready = self._wait_until_ready(tokenizer_load)
        except BaseException:
            self._terminate()
            raise
        self.source = ready.source
        self.max_context_tokens = ready.max_context_tokens
        self.model_name: str = self.source.path.stem
        self.pid: int | None = self._process.pid
        try:
            self.tokenizer = tokenizer_load.result(ready.tokenizer_source, ready.eos_token_ids)
        except BaseException:
            self._terminate()
            raise
        self._texts = StreamTexts(self.tokenizer) if self.tokenizer is not None else None
        if self._texts is not None:  # before any request: the engine sends their ids only from now on
            self._send(wire.LeaveTextDownstream())
        freeze_startup_objects()  # this process's start-up objects out of later collections (gc_pauses)
        self._reader = threading.Thread(target=self._read, name="snugkv-engine-reader", daemon=True)
        self._reader.start()

    def _wait_until_ready(self, tokenizer_load: TokenizerLoad) -> wire.Ready:
        """The engine's `Ready`; the tokenizer source it names first starts `tokenizer_load`."""
        while True:
            while not self._conn.poll(0.5):
                if not self._process.is_alive():
                    raise EngineProcessError(
                        f"the engine process exited with code {self._process.exitcode} before it was "
                        "ready; its log above says why"
                    )
            try:
                message = self._conn.recv()
            except (EOFError, OSError) as exc:
                raise EngineProcessError("the engine process closed its pipe before it was ready") from exc
            match message:
                case wire.Ready():
                    return message
                case wire.StartFailed(error):
                    raise error
                case wire.TokenizerSource(source):
                    tokenizer_load.start(source)
                case _:
                    raise EngineProcessError(
                        f"the engine process sent {type(message).__name__} before it was ready"
                    )

    # -- EngineClient ---------------------------------------------------------------------
    async def generate(self, request: GenerateInput) -> AsyncGenerator[GenerateOutput, None]:
        outputs = OutputStream()
        refusal = self._register(request, outputs)
        if refusal is not None:
            yield refusal
            return
        async for output in stream_until_finished(outputs, lambda: self.abort(request.rid)):
            yield output

    def _register(self, request: GenerateInput, outputs: OutputStream) -> GenerateOutput | None:
        """Register the request's stream and send it; an error output instead when it cannot run."""
        prompt_tokens = len(request.input_ids)
        with self._streams_lock:
            if self._gone is not None:
                return error_output(request.rid, prompt_tokens, self._gone)
            if request.rid in self._streams:  # as the engine answers a reused id, without the round trip
                return id_in_use_output(request)
            self._streams[request.rid] = (loop_mailbox(self._mailboxes), outputs)
            if self._texts is not None and not request.sampling.stop:  # stop strings: the engine's
                self._texts.open(request.rid)
        try:
            self._send(wire.Generate(request))
        except EngineProcessError as exc:
            with self._streams_lock:
                self._streams.pop(request.rid, None)
            if self._texts is not None:
                self._texts.close(request.rid)
            return error_output(request.rid, prompt_tokens, str(exc))
        return None

    def abort(self, rid: str) -> None:
        self._send_quietly(wire.AbortRequest(rid))

    def abort_all(self) -> None:
        """End every request in flight with finish_reason "abort" (the server is stopping)."""
        self._send_quietly(wire.AbortEveryRequest())

    def check_health(self) -> bool:
        if self._gone is not None or not self._process.is_alive():
            return False
        try:
            return self.call_blocking(wire.ReadHealth(), timeout_s=HEALTH_CALL_TIMEOUT_S)
        except EngineProcessError:
            return False

    # -- what the server's routes read or change, run by the engine's own EngineThread -------
    def server_info(self) -> EngineInfo:
        info = self.call_blocking(wire.ReadServerInfo())
        return dataclasses.replace(info, model=self.model_name, engine_process_pid=self.pid)

    def metrics_snapshot(self) -> MetricsSnapshot:
        return self.call_blocking(wire.ReadMetrics())

    def recent_steps(self) -> list[StepRecord]:
        return self.call_blocking(wire.ReadRecentSteps())

    def is_sleeping(self) -> bool:
        """Known in this process, without a call: only this server's sleep and wake calls change it,
        and their replies say what sleeps after them. (Every request asks; a blocking call per request
        held the event loop while requests arrived: bench http on a stub-device engine at ee1d60a.)
        After a sleep or wake call that failed, the engine is asked once."""
        if self._sleeping is None:
            self._sleeping = self.call_blocking(wire.ReadSleeping())
        return self._sleeping

    def sleep_state(self) -> SleepState:
        return self.call_blocking(wire.ReadSleepState())

    async def resize_kv(
        self, *, max_total_num_tokens: int | None = None, free_gib: float | None = None
    ) -> KvResizeReply:
        return await self.call(wire.ResizeKvCache(max_total_num_tokens, free_gib))

    async def kv_info(self) -> KvInfo:
        return await self.call(wire.ReadKvInfo())

    async def sleep(self, *, level: int = 1, tags: tuple[str, ...] = ()) -> SleepReply:
        return await self._sleep_or_wake(wire.SleepEngine(level, tuple(tags)))

    async def wake_up(self, *, tags: tuple[str, ...] = ()) -> SleepReply:
        return await self._sleep_or_wake(wire.WakeEngine(tuple(tags)))

    async def _sleep_or_wake(self, call: wire.Call[SleepReply]) -> SleepReply:
        self._sleeping = None  # asked again until the reply says
        reply = await self.call(call)
        self._sleeping = reply.state.is_sleeping
        return reply

    async def start_profile(self, *, output_dir: str | None = None, num_steps: int | None = None) -> str:
        return await self.call(wire.StartProfile(output_dir, num_steps))

    async def stop_profile(self) -> ProfileReport:
        return await self.call(wire.StopProfile())

    # -- calls ------------------------------------------------------------------------------
    async def call(self, call: wire.Call[ReplyT]) -> ReplyT:
        """`call` answered by the engine process (its error raised here as itself)."""
        return await asyncio.wrap_future(self._start_call(call))

    def call_blocking(self, call: wire.Call[ReplyT], *, timeout_s: float = SYNC_CALL_TIMEOUT_S) -> ReplyT:
        """`call` for the routes that read the engine synchronously, blocking the caller: the
        engine answers from its own event loop, between its scheduler's Python work, in well under
        a step; `EngineProcessError` after `timeout_s`."""
        future = self._start_call(call)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError as exc:
            raise EngineProcessError(
                f"the engine process did not answer {type(call).__name__} in {timeout_s:.0f} s"
            ) from exc

    def _start_call(self, call: wire.Call[ReplyT]) -> concurrent.futures.Future[ReplyT]:
        future: concurrent.futures.Future[ReplyT] = concurrent.futures.Future()
        call_id = next(self._call_ids)
        with self._streams_lock:
            if self._gone is not None:
                raise EngineProcessError(self._gone)
            self._calls[call_id] = future
        try:
            self._send(wire.Ask(call_id, call))
        except EngineProcessError:
            with self._streams_lock:
                self._calls.pop(call_id, None)
            raise
        return future

    def _settle_call(self, call_id: int, *, value: Any = None, error: BaseException | None = None) -> None:
        with self._streams_lock:
            future = self._calls.pop(call_id, None)
        if future is None or future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    # -- the pipe ---------------------------------------------------------------------------
    def _send(self, message: wire.ServerMessage) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            if self._gone is not None:
                raise EngineProcessError(self._gone)
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError) as exc:
                raise EngineProcessError(f"the engine process is gone ({exc})") from exc

    def _send_quietly(self, message: wire.ServerMessage) -> None:
        with contextlib.suppress(EngineProcessError):  # nothing runs there any more: nothing to abort
            self._send(message)

    def _read(self) -> None:
        """The reader thread: every message of the engine process, until its pipe closes."""
        try:
            while True:
                message: wire.EngineMessage = pickle.loads(self._conn.recv_bytes())
                match message:
                    case wire.TurnOutputs():
                        outputs = message.expanded()
                        if self._texts is not None:
                            for rid in self._texts.fill(outputs):  # its tokens broke the tokenizer
                                self._send_quietly(wire.AbortRequest(rid))
                        self._deliver(outputs)
                    case wire.CallAnswered(call_id, value):
                        self._settle_call(call_id, value=value)
                    case wire.CallFailed(call_id, error):
                        self._settle_call(call_id, error=error)
                    case _:
                        logger.error(
                            "the engine process sent a message the server does not know: %r", message
                        )
        except (EOFError, OSError):
            pass
        except Exception:
            logger.exception("reading the engine process's messages failed")
        if self._stopping:  # `stop` waits for the process
            self._fail_everything("the engine process has stopped (the server is shutting down)")
            return
        self._process.join(timeout=5.0)
        code = self._process.exitcode
        self._fail_everything(f"the engine process exited (code {code}); the server cannot generate any more")
        logger.error("The engine process exited unexpectedly (code %s)", code)
        self.died = f"the engine process exited with code {code}"
        if self._on_exit is not None:
            self._on_exit(self.died)

    def _deliver(self, outputs: list[GenerateOutput]) -> None:
        routed = []
        with self._streams_lock:
            for output in outputs:
                stream = self._streams.get(output.rid)
                if stream is None:
                    continue
                if output.finished:
                    del self._streams[output.rid]
                routed.append((*stream, output))
        _post(routed)

    def _fail_everything(self, message: str) -> None:
        with self._streams_lock:
            self._gone = self._gone or message
            streams, self._streams = self._streams, {}
            calls, self._calls = self._calls, {}
        if self._texts is not None:
            self._texts.clear()
        for future in calls.values():
            if not future.done():
                future.set_exception(EngineProcessError(message))
        _post(
            [(mailbox, stream, error_output(rid, 0, message)) for rid, (mailbox, stream) in streams.items()]
        )

    def stop(self) -> None:
        """Ask the engine to stop (its step finishes, its memory is released); kill it if it
        does not within `STOP_TIMEOUT_S`."""
        self._stopping = True
        self._send_quietly(wire.StopEngine())
        # The sentinel, not `is_alive`: the reader thread may reap the process meanwhile, and then
        # `is_alive` here cannot tell (waitpid fails) and says alive.
        if not multiprocessing.connection.wait([self._process.sentinel], STOP_TIMEOUT_S):
            logger.error("The engine process did not stop in %.0f s; killing it", STOP_TIMEOUT_S)
            self._process.kill()
        self._process.join(timeout=10.0)
        self._conn.close()
        self._reader.join(timeout=10.0)

    def _terminate(self) -> None:
        self._stopping = True
        if self._process.is_alive():
            self._process.kill()
        self._process.join(timeout=10.0)


def _post(routed: list[tuple[Mailbox, OutputStream, GenerateOutput]]) -> None:
    """Hand outputs to their streams: one post per event loop."""
    by_mailbox: dict[Mailbox, list[tuple[OutputStream, GenerateOutput]]] = {}
    for mailbox, stream, output in routed:
        by_mailbox.setdefault(mailbox, []).append((stream, output))
    for mailbox, items in by_mailbox.items():
        mailbox.post(items)


# -- the engine process -------------------------------------------------------------------------
class _PipeWriter:
    """The engine's messages to the server, sent in order on a thread of their own. `post` (the
    scheduler thread) and `send` (the event loop, a start-up message) only queue; outputs queued
    behind one another merge into one `TurnOutputs`. Once the server's end is gone, everything is
    dropped (the reader sees the pipe close)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: list[wire.EngineMessage | list[GenerateOutput]] = []
        self._ready = threading.Condition()
        self._closing = self._closed = False
        self._thread = threading.Thread(target=self._run, name="snugkv-pipe-writer", daemon=True)
        self._thread.start()

    def send(self, message: wire.EngineMessage) -> None:
        with self._ready:
            if not self._closed:
                self._queue.append(message)
                self._ready.notify()

    def post(self, items: list[tuple[Any, GenerateOutput]]) -> None:
        """A turn's outputs (the scheduler thread's `Outbox` hand-off)."""
        outputs = [output for _, output in items]
        with self._ready:
            if self._closed:
                return
            if self._queue and isinstance(self._queue[-1], list):
                self._queue[-1].extend(outputs)  # not sent yet: one message with the turn before
            else:
                self._queue.append(outputs)
                self._ready.notify()

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, then stop the thread (at most `timeout_s`)."""
        with self._ready:
            self._closing = True
            self._ready.notify()
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closing:
                    self._ready.wait()
                if not self._queue:
                    return
                queued, self._queue = self._queue, []
            for item in queued:
                message = wire.TurnOutputs.of(item) if isinstance(item, list) else item
                try:
                    self._conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
                except (OSError, ValueError):  # the server is gone; the reader sees the pipe close
                    with self._ready:
                        self._closed, self._queue = True, []
                    return


class _EngineSide:
    """The engine process's end of the pipe: a reader thread applying the server's messages, a
    writer thread sending the engine's, and an event loop (the main thread) answering the calls."""

    def __init__(self, conn: Connection, engine_thread: EngineThread) -> None:
        self.conn = conn
        self.engine_thread = engine_thread
        self.writer = _PipeWriter(conn)
        self.outbox = self.writer
        self.send = self.writer.send

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        reader = threading.Thread(
            target=self._read, args=(loop, stop), name="snugkv-pipe-reader", daemon=True
        )
        reader.start()
        await stop.wait()

    def _read(self, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
        try:
            while True:
                message: wire.ServerMessage = pickle.loads(self.conn.recv_bytes())
                match message:
                    case wire.Generate(request):
                        self.engine_thread.submit(request, self.outbox, None)
                    case wire.AbortRequest(rid):
                        self.engine_thread.abort(rid)
                    case wire.AbortEveryRequest():
                        self.engine_thread.abort_all()
                    case wire.LeaveTextDownstream():  # before any request: the server detokenizes
                        self.engine_thread.core.leave_text_downstream()
                    case wire.Ask():
                        asyncio.run_coroutine_threadsafe(self._answer(message), loop)
                    case wire.StopEngine():
                        break
                    case _:
                        logger.error(
                            "the server sent a message the engine process does not know: %r", message
                        )
        except (EOFError, OSError):  # the server's process is gone
            pass
        loop.call_soon_threadsafe(stop.set)

    async def _answer(self, ask: wire.Ask) -> None:
        reply: wire.CallAnswered | wire.CallFailed
        try:
            if not isinstance(ask.call, wire.Call):
                raise EngineProcessError(
                    f"the engine process has no call {ask.call!r}; "
                    "send one of snugkv.driver.wire's Call messages"
                )
            reply = wire.CallAnswered(ask.call_id, await ask.call.answer(self.engine_thread))
        except Exception as exc:
            reply = wire.CallFailed(ask.call_id, wire.crossing(exc))
        self.send(reply)


def send_start_failure(conn: Connection, exc: Exception) -> None:
    """Instead of `Ready`: the start-up error, for `EngineProcess` to raise as itself; closes the pipe."""
    conn.send(wire.StartFailed(wire.crossing(exc)))
    conn.close()


def _name_tokenizer_source(conn: Connection, spec: EngineSpec) -> None:
    """Tell the server where the tokenizer is before the engine starts, so it loads its copy
    meanwhile. Quietly nothing when the source cannot be resolved: the engine's start then fails
    with that error itself, or the server loads its copy after `Ready`."""
    args = spec.engine_args
    try:
        source = spec.tokenizer_source or resolve_model_source(
            args.load.model, args.load.load_format, args.load.revision
        )
    except Exception:
        logger.debug("the model's source is not known before the engine starts", exc_info=True)
        return
    conn.send(wire.TokenizerSource(source))


def engine_main(conn: Connection, spec: EngineSpec) -> None:
    """The engine process: build the engine, say `Ready` (or send the error), serve the pipe."""
    ignore_stop_signals()
    spec.log.configure()  # a no-op when `commands/engine_spawn` configured it already
    _name_tokenizer_source(conn, spec)
    try:  # built on the thread that will run its steps (EngineThread.build says why)
        engine_thread = EngineThread.build(
            lambda: EngineCore.build(
                spec.engine_args,
                tokenizer_source=spec.tokenizer_source,
                after_engine=spec.after_start,
            ),
            model_name=lambda core: core.engine.loaded.source.path.stem,
        )
    except Exception as exc:  # raised again in the server's process, which says it to the user
        logger.debug("the engine did not start", exc_info=True)
        send_start_failure(conn, exc)
        return
    engine = engine_thread.engine
    side = _EngineSide(conn, engine_thread)
    try:
        side.send(
            wire.Ready(
                source=engine.loaded.source,
                max_context_tokens=engine.context_length,
                eos_token_ids=engine.config.eos_token_ids,
                tokenizer_source=spec.tokenizer_source or engine.loaded.source,
            )
        )
        asyncio.run(side.serve())
    finally:
        engine_thread.stop()  # the scheduler thread ends after its step; the engine releases its memory
        side.writer.close()  # the last outputs and replies go out before the pipe closes
        conn.close()
