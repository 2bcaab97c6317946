"""The thread driver: an engine core on a scheduler thread of its own, behind an asyncio interface.

`EngineThread` implements `EngineClient` (what the server calls). Requests and aborts cross into the scheduler thread
through a queue. Outputs come back in batches: the scheduler thread posts everything a step
produced to the loop's `Mailbox` at once, which wakes the loop once (not once per request, and not
at all while a delivery is still waiting to run); the loop hands each output to its request's
`OutputStream`, which merges it into any output the consumer has not taken yet. So however far
behind the consumer is, it does one piece of work per request per wake-up, never one per token,
and the scheduler thread's hand-off costs one lock per step. A failure inside a step ends the requests in flight with an error (their state may
be half-updated) and the engine goes on with the next ones; it never takes the server down. If
the loop itself dies, every open and later request gets an error at once and /health says so.

With tensor parallelism this runs on rank 0; each turn's commands go to the other ranks first
(`EngineCore.share`), which run `follower.follow` over their own engine core.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from snugkv.core.engine_client import MetricsSink
from snugkv.core.outputs import GenerateInput, GenerateOutput
from snugkv.core.profiles import ProfileReport
from snugkv.core.reports import (
    EngineInfo,
    KvInfo,
    KvResize,
    KvResizeReply,
    MetricsSnapshot,
    SleepReply,
    SleepState,
    SlotAccounting,
)
from snugkv.core.sampling import InvalidRequest
from snugkv.core.stack_sampler import StackSampler
from snugkv.driver.commands import Abort, AbortAll, Add, Command, ResizeKV, Sleep, Stop, WakeUp
from snugkv.driver.engine_core import EngineCore
from snugkv.scheduler.launched import StepRecord
from snugkv.scheduler.request import Request

logger = logging.getLogger(__name__)

# The slot accounting check waits for this much idle time: on a pool of ~10^6 slots it takes
# ~0.1 s on a CPU (the allocator's partition check), which a request arriving meanwhile waits
# for. When it ran as soon as the engine went idle, bench http's passes on the H200 (cca1210) had
# their first step 0.12-0.38 s after the client sent its requests (in process: 0.02 s).
ACCOUNTING_CHECK_IDLE_S = 0.5

WakeGate = Callable[[tuple[str, ...]], contextlib.AbstractAsyncContextManager[None]]  # see `wake_gate`


class OutputStream:
    """One request's outputs on its event loop: what arrived and was not taken yet, merged into one
    output, and the consumer waiting for more. Used on the loop's thread only."""

    __slots__ = ("_pending", "_waiter")

    def __init__(self) -> None:
        self._pending: GenerateOutput | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, output: GenerateOutput) -> None:
        if self._pending is None:
            self._pending = output
        else:
            merge_into(self._pending, output)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> GenerateOutput:
        while self._pending is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        output, self._pending = self._pending, None
        return output


async def stream_until_finished(
    outputs: OutputStream, abort: Callable[[], None]
) -> AsyncIterator[GenerateOutput]:
    """A request's outputs as they come, until the finished one; `abort` runs when the consumer
    leaves before that (a closed stream or a disconnected client)."""
    finished = False
    try:
        while not finished:
            output = await outputs.get()
            finished = output.finished
            yield output
    finally:
        if not finished:
            abort()


def error_output(
    rid: str, prompt_tokens: int, message: str, *, rejected: bool = False, param: str | None = None
) -> GenerateOutput:
    """The one output of a request that ends with `message` (`rejected`: the request as it is, a
    400 about field `param` where it names one)."""
    return GenerateOutput(
        rid=rid,
        token_ids=[],
        text="",
        finished=True,
        finish_reason="error",
        prompt_tokens=prompt_tokens,
        error=message,
        rejected=rejected,
        error_param=param,
    )


def id_in_use_output(request: GenerateInput) -> GenerateOutput:
    """The refusal of a request whose id a running request holds."""
    message = f"request id {request.rid!r} is already in use; send each request with its own id"
    return error_output(request.rid, len(request.input_ids), message, rejected=True)


def loop_mailbox(mailboxes: dict[asyncio.AbstractEventLoop, Mailbox]) -> Mailbox:
    """The running loop's mailbox in `mailboxes` (made on its first request: a server has one loop,
    tests may have more; those of closed loops are dropped then)."""
    loop = asyncio.get_running_loop()
    mailbox = mailboxes.get(loop)
    if mailbox is None:
        for old in [old for old in mailboxes if old.is_closed()]:
            del mailboxes[old]
        mailbox = mailboxes.setdefault(loop, Mailbox(loop))
    return mailbox


def merge_into(earlier: GenerateOutput, later: GenerateOutput) -> None:
    """`earlier` becomes both outputs as one (the tokens, text and logprobs of both, in order; the
    later's state). Both are deltas of one request, `earlier` not yet seen by anyone."""
    earlier.token_ids.extend(later.token_ids)
    earlier.text += later.text
    earlier.logprobs.extend(later.logprobs)
    earlier.finished = later.finished
    earlier.finish_reason = later.finish_reason
    earlier.prompt_tokens = later.prompt_tokens or earlier.prompt_tokens
    earlier.completion_tokens = max(earlier.completion_tokens, later.completion_tokens)
    earlier.cached_tokens = max(earlier.cached_tokens, later.cached_tokens)
    earlier.error = later.error if later.error is not None else earlier.error
    earlier.rejected = earlier.rejected or later.rejected
    earlier.retry_after_s = later.retry_after_s if later.retry_after_s is not None else earlier.retry_after_s


class Outbox(Protocol):
    """Where a request's outputs go: the scheduler thread posts a turn's (stream, output) pairs in
    one call. `Mailbox` delivers them on an event loop of this process; an engine process
    (`engine_process`) sends them to the server's process."""

    def post(self, items: list[tuple[Any, GenerateOutput]]) -> None: ...


class Mailbox:
    """Outputs bound for one event loop. The scheduler thread posts a step's outputs in one call;
    the loop is woken only when no delivery is already waiting to run there."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[OutputStream, GenerateOutput]] = []
        self._scheduled = False

    def post(self, items: list[tuple[OutputStream, GenerateOutput]]) -> None:
        with self._lock:
            if self.loop.is_closed():  # the server is gone: nobody reads these
                return
            self._items.extend(items)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed (the server is shutting down): nobody reads these
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for stream, output in items:
            stream.put(output)


@dataclass(frozen=True, slots=True)
class Submit:
    """A new request with the stream its outputs go to; taken from the inbox, it becomes an `Add`
    (what the ranks share) and its stream is registered."""

    request: GenerateInput
    mailbox: Outbox
    outputs: Any  # the `OutputStream` (or whatever the outbox routes by) each output is posted with


@dataclass(frozen=True, slots=True)
class Control:
    """A command every rank applies (a KV resize, sleep, wake) whose result goes back to `reply`."""

    command: Command
    loop: asyncio.AbstractEventLoop
    reply: asyncio.Future[Any]


@dataclass(frozen=True, slots=True)
class Query:
    """A read of the scheduler's state on rank 0 alone, between steps (never shared)."""

    read: Callable[[EngineCore], Any]
    loop: asyncio.AbstractEventLoop
    reply: asyncio.Future[Any]


InboxItem = Submit | Abort | AbortAll | Control | Query


class EngineThread:
    """An engine core on a thread of its own; starts the thread at once and serves until `stop`.

    `EngineThread.build(...)` builds the core on that thread: the thread that runs every step then
    made its cuBLAS / cuBLASLt handles and workspaces (torch keeps them per thread) while start-up
    captured and measured, before the KV cache was sized, so serving never creates one (on a device
    another process filled, `cublasCreate` inside a step fails)."""

    @classmethod
    def build(
        cls,
        build_core: Callable[[], EngineCore],
        *,
        model_name: str | Callable[[EngineCore], str],
        metrics: MetricsSink | None = None,
    ) -> EngineThread:
        """Start the scheduler thread, build the core there (`build_core`), then serve on it;
        returns once the core is built, or raises what building it raised."""
        handoff: queue.SimpleQueue[EngineThread | BaseException] = queue.SimpleQueue()

        def run() -> None:
            try:
                core = build_core()
                name = model_name(core) if callable(model_name) else model_name
                engine_thread = cls(core, model_name=name, metrics=metrics, thread=threading.current_thread())
            except BaseException as exc:  # raised again in the caller's thread
                handoff.put(exc)
                return
            handoff.put(engine_thread)
            engine_thread._loop()

        threading.Thread(target=run, name="snugkv-scheduler", daemon=True).start()
        result = handoff.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def __init__(
        self,
        core: EngineCore,
        *,
        model_name: str,
        metrics: MetricsSink | None = None,
        thread: threading.Thread | None = None,
    ) -> None:
        """`thread`: the running thread that will drive the core (`build`); None: start one now."""
        self.core = core
        self.engine = core.engine
        self.scheduler = core.scheduler
        self.tokenizer = core.tokenizer
        self.model_name = model_name
        self.max_context_tokens = core.context_length
        self.metrics = metrics
        core.deliver_outputs_to(self._on_output)
        self._inbox: queue.SimpleQueue[InboxItem] = queue.SimpleQueue()
        self._streams: dict[str, tuple[Outbox, Any]] = {}
        self._mailboxes: dict[asyncio.AbstractEventLoop, Mailbox] = {}  # one per client loop
        self._outbox: dict[Outbox, list[tuple[Any, GenerateOutput]]] = {}  # this turn's
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._broken: str | None = None  # why the scheduler loop died, if it did
        self.aborted_rids: deque[str] = deque(maxlen=4096)
        self.step_errors = 0
        # Entered around every wake, before the command is sent: --kv-elastic asks the other
        # engines on the device for the memory first (memory_share.wake); None: no gate.
        self.wake_gate: WakeGate | None = None
        self._accounting_checked = False
        self._idle_since: float | None = None  # when the scheduler last ran out of work
        self.slot_accounting = SlotAccounting()
        self._replies: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._queries: list[Query] = []
        if thread is None:
            thread = threading.Thread(target=self._loop, name="snugkv-scheduler", daemon=True)
            thread.start()
        self._thread = thread

    # -- EngineClient -------------------------------------------------------------------
    async def generate(self, request: GenerateInput) -> AsyncGenerator[GenerateOutput, None]:
        outputs = OutputStream()
        self.submit(request, loop_mailbox(self._mailboxes), outputs)
        async for output in stream_until_finished(outputs, lambda: self.abort(request.rid)):
            yield output

    def submit(self, request: GenerateInput, mailbox: Outbox, outputs: Any) -> None:
        """Queue `request`, its outputs to be posted to `mailbox` with `outputs` (`generate` is this
        plus the waiting); when the scheduler loop is gone, its error output is posted at once."""
        self._inbox.put(Submit(request, mailbox, outputs))
        self._wake.set()
        if self._broken is not None:  # nobody will take the request
            mailbox.post([(outputs, error_output(request.rid, len(request.input_ids), self._broken))])

    def abort(self, rid: str) -> None:
        if rid not in self.aborted_rids:  # a client that disconnects is aborted by the stream and the server
            self.aborted_rids.append(rid)
        self._inbox.put(Abort(rid))
        self._wake.set()

    def abort_all(self) -> None:
        """End every request in flight with finish_reason "abort" (the server is stopping)."""
        self._inbox.put(AbortAll())
        self._wake.set()

    def check_health(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set() and self._broken is None

    # -- elastic memory (run on the scheduler thread between steps) ---------------------
    async def resize_kv(
        self, *, max_total_num_tokens: int | None = None, free_gib: float | None = None
    ) -> KvResizeReply:
        """Resize the KV cache on every rank; raises `KvResizeError` naming the limit."""
        change = await self._control(ResizeKV(max_total_num_tokens, free_gib))
        return KvResizeReply(change, await self.kv_info())

    async def kv_info(self) -> KvInfo:
        info: KvInfo = await self._query(EngineCore.kv_info)
        return info

    async def sleep(self, *, level: int = 1, tags: tuple[str, ...] = ()) -> SleepReply:
        """Release memory on every rank (requests in flight wait in the queue); raises
        `KvResizeError` when the engine cannot."""
        change = await self._control(Sleep(level, tuple(tags)))
        return SleepReply(change, self.sleep_state())

    async def wake_up(self, *, tags: tuple[str, ...] = ()) -> SleepReply:
        gate = self.wake_gate
        async with gate(tuple(tags)) if gate is not None else contextlib.nullcontext():
            change = await self._control(WakeUp(tuple(tags)))
        return SleepReply(change, self.sleep_state())

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    # -- profiling (run on the scheduler thread between steps: driver.profiling) -----------
    async def start_profile(self, *, output_dir: str | None = None, num_steps: int | None = None) -> str:
        """Record the next steps; returns the folder the trace goes to (`ProfileError` if one runs)."""
        folder: str = await self._query(lambda core: core.start_profile(output_dir, num_steps))
        return folder

    async def stop_profile(self) -> ProfileReport:
        """End the profile between two steps; its trace is written off the scheduler thread."""
        written: concurrent.futures.Future[ProfileReport] = await self._query(EngineCore.stop_profile)
        return await asyncio.wrap_future(written)

    def sleep_state(self) -> SleepState:
        return self.core.sleep_state()

    async def _control(self, command: Command) -> KvResize:
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[KvResize] = loop.create_future()
        self._inbox.put(Control(command, loop, reply))
        self._wake.set()
        if self._broken is not None:
            raise RuntimeError(self._broken)
        return await reply

    async def _query(self, read: Callable[[EngineCore], Any]) -> Any:
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[Any] = loop.create_future()
        self._inbox.put(Query(read, loop, reply))
        self._wake.set()
        if self._broken is not None:
            raise RuntimeError(self._broken)
        return await reply

    def metrics_snapshot(self) -> MetricsSnapshot:
        return self.core.metrics_snapshot()

    def server_info(self) -> EngineInfo:
        return self.core.info(
            model_name=self.model_name,
            step_errors=self.step_errors,
            aborted_rids=tuple(self.aborted_rids),
            slot_accounting=self.slot_accounting,
        )

    def recent_steps(self) -> list[StepRecord]:
        """The last steps one by one (`launched.StepRecord`s: launch time, kind, size, device time
        and the device's idle gap before each); `launched.summarize_steps` reads them."""
        return list(self.scheduler.times.records)  # one C-level copy: safe beside the scheduler thread

    # -- scheduler thread ---------------------------------------------------------------
    def _loop(self) -> None:
        sampler = StackSampler.from_env(threading.get_ident())  # SNUGKV_SAMPLE_SCHEDULER=path
        if sampler is not None:
            logger.info("sampling the scheduler thread's stack into %s", sampler.path)
            sampler.start()
        try:
            self._turns()
        except BaseException as exc:  # a bug outside a step (steps catch their own failures)
            logger.exception("the scheduler loop died; the engine takes no more requests")
            self._broken = f"the engine stopped after an internal error: {type(exc).__name__}: {exc}"
            self._fail_every_stream(self._broken)
        finally:
            if sampler is not None:
                sampler.stop()

    def _fail_every_stream(self, message: str) -> None:
        """End every open stream, every request still in the inbox and every waiting control or
        query, with `message`."""
        self._take_inbox()  # registers the streams of requests that were never applied
        for loop, reply in [*self._replies.values(), *((q.loop, q.reply) for q in self._queries)]:
            _settle(loop, reply, error=RuntimeError(message))
        self._replies.clear()
        self._queries.clear()
        for rid, (mailbox, outputs) in list(self._streams.items()):
            self._streams.pop(rid, None)
            self._send(mailbox, outputs, error_output(rid, 0, message))
        self._flush_outbox()

    def _turns(self) -> None:
        while True:
            stopping = self._stopped.is_set()
            commands = self._take_inbox()
            if stopping:
                commands.append(Stop())
            commands = self.core.share(commands)  # the other ranks apply the same, in order
            for index, command in enumerate(commands):
                self._apply(command, self._replies.pop(index, None))
            self._flush_outbox()  # refusals, and the ends of aborted requests
            self._answer_queries()
            if stopping:
                return
            if not self.scheduler.has_work:
                now = time.monotonic()
                self._idle_since = self._idle_since or now
                if now - self._idle_since >= ACCOUNTING_CHECK_IDLE_S:
                    self._check_accounting_when_idle()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            self._accounting_checked = False
            self._idle_since = None
            if self.scheduler.only_waits_for_memory:  # nothing a step can do: do not spin
                self._wake.wait(0.01)
                self._wake.clear()
            error = self.core.step()
            self._flush_outbox()
            if error is not None:
                self.step_errors += 1
                logger.error("scheduler step failed; ended the requests it held", exc_info=error)
            if self.metrics is not None:
                self.metrics.update_from_stats(self.scheduler.stats())

    def _check_accounting_when_idle(self) -> None:
        """With nothing in flight, every slot must be free or in the prefix cache."""
        if self._accounting_checked:
            return
        self._accounting_checked = True
        allocator = self.scheduler.runner.allocator
        try:
            self.scheduler.check_slot_accounting()
            ok, detail = True, "free + cached == capacity"
        except Exception as exc:
            ok, detail = False, str(exc)
            logger.error("slot accounting failed: %s", exc)
        self.slot_accounting = SlotAccounting(
            checked=True,
            ok=ok,
            detail=detail,
            free_tokens=allocator.available_tokens,
            cached_tokens=self.scheduler.cache.cached_tokens,
            capacity_tokens=allocator.capacity_tokens,
        )

    def _take_inbox(self) -> list[Command]:
        """This turn's commands; a new request's stream is registered as it is taken, a control's
        reply under its command's index, a query set aside for after the commands."""
        commands: list[Command] = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return commands
            if isinstance(item, Control):
                self._replies[len(commands)] = (item.loop, item.reply)
                commands.append(item.command)
                continue
            if isinstance(item, Query):
                self._queries.append(item)
                continue
            if not isinstance(item, Submit):
                commands.append(item)
                continue
            request = item.request
            if request.rid in self._streams:  # the running request keeps its stream
                self._send(item.mailbox, item.outputs, id_in_use_output(request))
                continue
            self._streams[request.rid] = (item.mailbox, item.outputs)
            commands.append(Add(request.rid, request.input_ids, request.sampling))

    def _apply(
        self, command: Command, reply: tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]] | None
    ) -> None:
        if reply is not None:  # a control: its outcome, success or error, goes to whoever asked
            try:
                result = self.core.apply(command)
            except Exception as exc:
                _settle(*reply, error=exc)
            else:
                _settle(*reply, result=result)
            if self.metrics is not None:
                self.metrics.update_from_snapshot(self.metrics_snapshot())
            return
        try:
            self.core.apply(command)
        except (
            Exception
        ) as exc:  # InvalidRequest: a 400; anything else: this request's 500, not the engine's end
            if not isinstance(command, Add):
                raise
            if not isinstance(exc, InvalidRequest):
                logger.exception("adding request %s failed", command.rid)
            mailbox, outputs = self._streams.pop(command.rid)
            rejected = isinstance(exc, InvalidRequest)
            failed = error_output(
                command.rid,
                len(command.input_ids),
                str(exc),
                rejected=rejected,
                param=exc.param if isinstance(exc, InvalidRequest) else None,
            )
            self._send(mailbox, outputs, failed)

    def _answer_queries(self) -> None:
        while self._queries:
            query = self._queries.pop(0)
            try:
                result = query.read(self.core)
            except Exception as exc:
                _settle(query.loop, query.reply, error=exc)
            else:
                _settle(query.loop, query.reply, result=result)

    def _on_output(self, request: Request, output: GenerateOutput) -> None:
        stream = self._streams.get(request.rid)
        if stream is None:
            return
        if output.finished:
            self._streams.pop(request.rid, None)
        self._send(*stream, output)

    def _send(self, mailbox: Outbox, outputs: Any, output: GenerateOutput) -> None:
        """Queue `output` for this turn's delivery (`_flush_outbox`); scheduler thread only."""
        pending = self._outbox.get(mailbox)
        if pending is None:
            self._outbox[mailbox] = [(outputs, output)]
        else:
            pending.append((outputs, output))

    def _flush_outbox(self) -> None:
        """Post what this turn produced: one hand-off per client loop."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        for mailbox, items in outbox.items():
            mailbox.post(items)

    def stop(self, *, close_engine: bool = True) -> None:
        """Stop the scheduler thread, then release graphs, pools and the arena (unless the engine
        is to serve on, as a benchmark's next case does)."""
        self._stopped.set()
        self._wake.set()
        self._thread.join()  # a step in flight finishes first: its pools must outlive it
        if close_engine:
            self.core.close()


def _settle(
    loop: asyncio.AbstractEventLoop,
    reply: asyncio.Future[Any],
    *,
    result: Any = None,
    error: BaseException | None = None,
) -> None:
    """Resolve a future of another thread's loop (nothing when the caller's loop is gone)."""

    def resolve() -> None:
        if reply.done():
            return
        if error is not None:
            reply.set_exception(error)
        else:
            reply.set_result(result)

    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(resolve)
