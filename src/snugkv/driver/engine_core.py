"""The engine core: one rank's engine, its tokenizer and the scheduler over them, and the three
things every driver does with them: share a turn of commands, apply each, step; or, for a caller
that holds the core alone, `submit` requests and `run` until they are done.

`EngineCore.build(args)` is the one place that assembles them (the engine's start-up pipeline, the
model's tokenizer, a scheduler set up from the engine's flags and sizing); `EngineCore.around`
wraps an engine already built (a benchmark's stub device, a test's engine). Every driver wraps a
core and adds only how commands reach it and where outputs go: the thread behind the server
(`engine_thread`), the engine process (`engine_process`), the helper ranks of `--tp N`
(`follower`) and the Python API (`snugkv.llm`) take turns; the interactive commands (`snugkv
generate`, `chat`) and the benchmarks that run requests in process `submit` them and `run`, the
synchronous loop that takes no turns. Every step of every driver is the core's (`step` and `run`
share it), so a change to what a step does lands here.

Tensor parallelism: rank 0 hears clients. At each turn it sends that turn's commands to the other
ranks (`share`, over the CPU group), and every rank applies the same commands, in the same order,
to its own scheduler, then steps if there is work. A scheduler is deterministic given its
commands and the sampled tokens (which rank 0 broadcasts inside `ModelRunner.sample_on_device`),
so every rank batches the same rows and meets the others in the same collectives. A leader that
may leave the ranks idle for long (the Python API between calls, a person thinking) sends the
turns that find no work over the group without the collectives' timeout (`turns_wait_on_user`,
set alike on every rank: every rank sees the same `has_work`, so all pick the same group); a
server's leader sends a turn at least every 50 ms and keeps to the CPU group. At tp=1 `share` is
the identity and nothing crosses a process boundary.

Memory pressure: on rank 0, `share` adds a `CheckMemory` command to a turn every
`MEMORY_CHECK_S` (and at the first turn after a step ran out of memory), so every rank measures
free memory at the same point of the same turn and takes the same decision
(`driver.pressure.relieve_pressure`: shrink by the deficit, grow back with hysteresis). Engines
that cannot resize (plain memory, profiled sizing) or run with `--no-kv-pressure` never get one.
A request queued for memory the KV cache does not hold now (`Scheduler.waits_for_memory`) is ended
by an `ExpireWait` that rank 0 adds once it waited `--queue-timeout` (a 503 with Retry-After).

The core never blocks on I/O, never owns a thread, and never decides when to take a turn (`run`
takes none: it applies and steps on this rank only, and leaves when the work is done).
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import time
from collections.abc import Callable, Iterable

from snugkv.core.gc_pauses import GC_PAUSES
from snugkv.core.profiles import ProfileReport
from snugkv.core.reports import (
    EngineInfo,
    KvInfo,
    KvResize,
    MemoryReport,
    MetricsSnapshot,
    SchedulerStats,
    SleepState,
    SlotAccounting,
)
from snugkv.distributed.group import TensorParallel
from snugkv.driver.commands import (
    Abort,
    AbortAll,
    Add,
    CheckMemory,
    Command,
    ExpireWait,
    ResetPrefixCache,
    ResizeKV,
    Sleep,
    Stop,
    Turn,
    WakeUp,
)
from snugkv.driver.pressure import relieve_pressure
from snugkv.driver.profiling import StepProfiler
from snugkv.engine import Engine, EngineArgs
from snugkv.engine.kv_sizing import StartGate
from snugkv.models.loader import ModelSource, resolve_model_source
from snugkv.models.tokenizer import Tokenizer, TokenizerUnavailable, load_tokenizer
from snugkv.scheduler import elastic
from snugkv.scheduler.outputs import OutputCallback
from snugkv.scheduler.request import Request
from snugkv.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

MEMORY_CHECK_S = 0.25  # how often rank 0 has every rank measure free memory (a sync and a read)
RETRY_AFTER_S = 5.0  # what a 503 for a request that waited for memory in vain tells the client


def load_tokenizer_or_none(
    source: ModelSource,
    eos_token_ids: tuple[int, ...] = (),
    *,
    warn: bool = False,
    whose: str = "the",
    warn_missing: bool = True,
) -> tuple[Tokenizer | None, str | None]:
    """The model's tokenizer, or None and why there is none (a bare config with random weights:
    prompts are then token ids); `warn` logs the load (with its seconds) or, unless `warn_missing`
    is off (another copy says it), the reason; `whose` names the copy in that line ("the engine's",
    "the server's")."""
    started = time.perf_counter()
    try:
        tokenizer = load_tokenizer(source, eos_token_ids)
    except TokenizerUnavailable as exc:
        if warn and warn_missing:
            logger.warning("%s", exc)
        return None, str(exc)
    if warn:
        logger.info(
            "Loaded %s tokenizer (vocab %d) from %s in %.2f s",
            whose,
            tokenizer.vocab_size,
            source.path.name,
            time.perf_counter() - started,
        )
    return tokenizer, None


def _load_tokenizer_early(
    args: EngineArgs, source: ModelSource | None, tp: TensorParallel | None
) -> concurrent.futures.Future[tuple[Tokenizer | None, str | None]] | None:
    """`load_tokenizer_or_none` of the model's tokenizer on a thread of its own, begun before the
    engine starts; None when the model's source is not known yet (the engine's load then says why,
    and the tokenizer loads after it)."""
    try:
        source = source or resolve_model_source(args.load.model, args.load.load_format, args.load.revision)
    except Exception:
        logger.debug("the tokenizer's source is not known before the engine starts", exc_info=True)
        return None
    warn = tp is None or tp.is_first_rank
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="snugkv-tokenizer")
    try:
        return pool.submit(_load_beside_the_start, source, warn)
    finally:
        pool.shutdown(wait=False)  # the thread ends with its load


# The interpreter's switch interval while the engine's tokenizer loads beside the start (Python's
# default: 5 ms). The load is pure Python for seconds (transformers' import), and a thread that lets
# the GIL go for a moment (a system call: a CUDA launch or copy) waits up to a whole interval to get
# it back from a busy one: 200 `time.sleep(0)` took 0.7-1.5 s beside a busy thread at 5 ms and
# 0.05-0.25 s at 0.5 ms on a CI CPU. On the H100 at 994bded the 8B shape's random weights took
# 1.1-1.6 s to load beside the tokenizer and 0.1 s without one, the whole start 12.9 s against
# 10.8 s (docs/bench/startup.md); what this interval changes there is not measured yet.
START_SWITCH_INTERVAL_S = 0.0005


def _load_beside_the_start(source: ModelSource, warn: bool) -> tuple[Tokenizer | None, str | None]:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(min(previous, START_SWITCH_INTERVAL_S))
    try:
        return load_tokenizer_or_none(source, warn=warn, whose="the engine's")
    finally:
        sys.setswitchinterval(previous)


class EngineCore:
    """One rank's engine, tokenizer and scheduler. Build it with `build` (or `around` an engine
    already started); a driver then takes turns (`share`, `apply` each command, `step`), or
    `submit`s requests and `run`s until they are done."""

    def __init__(
        self,
        engine: Engine,
        scheduler: Scheduler,
        tokenizer: Tokenizer | None,
        *,
        no_tokenizer: str | None = None,
        turns_wait_on_user: bool = False,
    ) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.no_tokenizer = no_tokenizer  # why `tokenizer` is None, if it is
        self.turns_wait_on_user = turns_wait_on_user
        self.tp: TensorParallel = engine.tp
        # One rank cannot retry a step alone: with tp the others are in its collectives.
        scheduler.retry_out_of_memory = not self.tp.enabled
        self._next_memory_check_s = time.monotonic() + MEMORY_CHECK_S
        self._oom_retries_seen = 0
        self._memory_waits: dict[str, float] = {}  # rank 0: when each request began to wait for memory
        self._next_wait_scan_s = 0.0
        if engine.kv.resizable:  # a prompt the cache could grow to hold waits for memory, not a 400
            scheduler.could_hold_tokens = engine.kv.largest_tokens()
        self.profiler = StepProfiler(engine.device)  # POST /start_profile: this rank's steps

    # -- assembling -------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        args: EngineArgs,
        *,
        tp: TensorParallel | None = None,
        tokenizer_source: ModelSource | None = None,
        tokenizer: Tokenizer | None = None,
        after_engine: Callable[[Engine], None] | None = None,
        turns_wait_on_user: bool = False,
        start_gate: StartGate | None = None,
    ) -> EngineCore:
        """Start the engine for `args` (this rank of `tp`), load the tokenizer of its model (or of
        `tokenizer_source`) and set the scheduler up over it. `after_engine(engine)` runs as soon as
        the engine is sized, before the tokenizer loads (a memory share publishes its size then; a
        benchmark installs its stub device). `tokenizer`: the one the caller loaded already for
        this model (read again, it would cost a command's start-up some 0.1-0.3 s); it gets the
        model's EOS ids. `turns_wait_on_user`: see the module's docstring. `start_gate`: the KV
        bytes agreed with engines starting together (`KvSizing`)."""
        # The tokenizer loads on a thread of its own while the engine starts (1.8 s for a 128k-vocab
        # tokenizer on the H100 at e86cb6c, on the start's path until then); its EOS ids are the
        # model's, known once the engine has loaded it.
        early = None if tokenizer is not None else _load_tokenizer_early(args, tokenizer_source, tp)
        try:
            engine = Engine(args, tp=tp, start_gate=start_gate)
        except BaseException:
            if early is not None:
                early.cancel()
            raise
        try:
            if after_engine is not None:
                after_engine(engine)
            why: str | None = None
            if tokenizer is None and early is not None:
                tokenizer, why = early.result()
            elif tokenizer is None:
                tokenizer, why = load_tokenizer_or_none(
                    tokenizer_source or engine.loaded.source,
                    warn=engine.tp.is_first_rank,
                    whose="the engine's",
                )
            if tokenizer is not None:
                tokenizer = tokenizer.with_eos_token_ids(engine.config.eos_token_ids)
            core = cls.around(engine, tokenizer=tokenizer)
        except BaseException:
            engine.close()
            raise
        core.no_tokenizer = why
        core.turns_wait_on_user = turns_wait_on_user
        return core

    @classmethod
    def around(
        cls,
        engine: Engine,
        *,
        tokenizer: Tokenizer | None = None,
        on_output: OutputCallback | None = None,
        overlap: bool | None = None,
        max_running_requests: int | None = None,
        use_host_tier: bool = True,
    ) -> EngineCore:
        """A core over an engine already started. The scheduler takes its runner, EOS ids,
        re-capped request limit, prefill chunk, overlap setting and host tier from the engine (every
        tensor-parallel rank builds the same one); `overlap`, `max_running_requests` and
        `use_host_tier` override the engine's for a benchmark or a test that compares them."""
        args, runner = engine.args, engine.runner
        if runner is None:
            raise RuntimeError("the engine is closed")
        scheduler = Scheduler(
            runner,
            tokenizer=tokenizer,
            eos_token_ids=engine.config.eos_token_ids,
            max_running_requests=max_running_requests or engine.report.max_running_requests,
            request_cap=lambda: engine.report.max_running_requests,
            chunked_prefill_size=args.scheduler.chunked_prefill_size,
            enable_prefix_cache=args.cache.enable_prefix_cache,
            on_output=on_output,
            overlap=not args.scheduler.disable_overlap_schedule if overlap is None else overlap,
            mixed=not args.scheduler.disable_mixed_steps,
            host_tier=engine.host_tier if use_host_tier else None,
            speculative=args.speculative,
        )
        return cls(engine, scheduler, tokenizer)

    def leave_text_downstream(self) -> None:
        """From now on a request without stop strings gets its token ids only, no text: whoever
        receives the outputs detokenizes them (the engine process's server), so the thread that
        steps does not. A request with stop strings is still detokenized here (its text decides
        when it ends)."""
        self.scheduler.outputs.text_downstream = True

    def deliver_outputs_to(self, on_output: OutputCallback | None) -> None:
        """Where the scheduler sends each request's outputs from now on (the driver's callback)."""
        self.scheduler.outputs.on_output = on_output

    # -- a turn -----------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def context_length(self) -> int:
        """Tokens a prompt and its output may take together."""
        return self.engine.context_length

    def share(self, commands: Turn | None) -> Turn:
        """Rank 0's commands of this turn, on every rank (the others pass None). When a memory check
        is due, rank 0's list gets a `CheckMemory` appended in place (so a driver that applies its
        own list applies it too, as every other rank does)."""
        stopping = any(isinstance(command, Stop) for command in commands or ())  # the others leave at Stop
        if commands is not None and self.tp.is_first_rank and not stopping:
            if self._memory_check_due():
                commands.append(CheckMemory())
            commands.extend(self._expired_waits())
        if not self.tp.enabled:  # one rank: nothing to send, and nothing more to do per turn
            return commands or []
        wait_for_user = self.turns_wait_on_user and not self.has_work
        shared: Turn = self.tp.broadcast_object_from_first(commands, wait_for_user=wait_for_user)
        return shared

    def _memory_check_due(self) -> bool:
        """Rank 0's clock: a memory check every `MEMORY_CHECK_S`, or now after a step ran out."""
        if not self.engine.watches_pressure:
            return False
        now = time.monotonic()
        retried = self.scheduler.oom_retries != self._oom_retries_seen
        if now < self._next_memory_check_s and not retried:
            return False
        self._oom_retries_seen = self.scheduler.oom_retries
        self._next_memory_check_s = now + MEMORY_CHECK_S
        return True

    def _expired_waits(self) -> list[ExpireWait]:
        """Rank 0's clock, every `MEMORY_CHECK_S`: the queued requests that waited for memory for
        `--queue-timeout` (the scan is O(queue), so it does not run every turn)."""
        scheduler = self.scheduler
        if scheduler.could_hold_tokens is None:
            return []
        now = time.monotonic()
        if now < self._next_wait_scan_s:
            return []
        self._next_wait_scan_s = now + MEMORY_CHECK_S
        waits = {
            r.rid: self._memory_waits.get(r.rid, now)
            for r in scheduler.waiting
            if scheduler.waits_for_memory(r)
        }
        self._memory_waits = waits
        timeout_s = self.engine.args.scheduler.queue_timeout_s
        return [ExpireWait(rid) for rid, since in waits.items() if now - since >= timeout_s]

    def apply(self, command: Command) -> KvResize | None:
        """One command on this rank's scheduler; returns what an elastic-memory command did. `Add`
        raises `InvalidRequest` and the elastic commands `KvResizeError` on every rank alike."""
        scheduler = self.scheduler
        if isinstance(command, Add):
            self.submit((command,))
        elif isinstance(command, Abort):
            scheduler.abort(command.rid)
        elif isinstance(command, AbortAll):
            for rid in list(scheduler.requests):
                scheduler.abort(rid)
        elif isinstance(command, ResetPrefixCache):
            scheduler.cache.reset()
        elif isinstance(command, ResizeKV):
            return elastic.resize_kv(
                scheduler,
                self.engine,
                max_total_num_tokens=command.max_total_num_tokens,
                free_gib=command.free_gib,
            )
        elif isinstance(command, Sleep):
            return elastic.sleep(scheduler, self.engine, level=command.level, tags=command.tags)
        elif isinstance(command, WakeUp):
            return elastic.wake_up(scheduler, self.engine, tags=command.tags)
        elif isinstance(command, CheckMemory):
            return self._relieve_pressure()
        elif isinstance(command, ExpireWait):
            scheduler.expire_wait(command.rid, RETRY_AFTER_S)
        elif not isinstance(command, Stop):
            raise TypeError(f"not an engine command: {command!r}")
        return None

    def _relieve_pressure(self) -> KvResize | None:
        """A memory check (`driver.pressure`); a move that breaks for another reason than a refusal
        (which it logs and retries at the next check) ends the requests it held, as a failed step
        does, instead of the driver's loop."""
        try:
            return relieve_pressure(self.scheduler, self.engine)
        except Exception as exc:
            logger.exception("a memory-pressure move failed; ended the requests in flight")
            self.scheduler.fail_all(
                f"internal error while resizing the KV cache: {type(exc).__name__}: {exc}"
            )
            return None

    def step(self) -> Exception | None:
        """One scheduler step; a failure ends the requests it held and is returned.

        With several ranks they first agree whether any of them failed (over the CPU group), and if
        one did, every rank ends all its requests and empties its prefix cache, so their states are
        the same again whichever rank broke. That covers failures after the step's last collective
        (output handling, detokenizing: the rank-local part of a step). A rank that fails before or
        inside a collective the others are in leaves them waiting there (NCCL) or aborts them
        (gloo): that ends the launch, not just the step.
        """
        scheduler = self.scheduler
        error: Exception | None = None
        try:
            self._step_scheduler()
        except Exception as exc:  # one bad step must not take the engine down
            error = exc
        if not self.tp.any_rank(error is not None):
            return None
        if error is None:
            error = RuntimeError("a step failed on another tensor-parallel rank")
        scheduler.fail_all(f"internal error while generating: {type(error).__name__}: {error}")
        if self.tp.enabled:
            scheduler.cache.reset()
        return error

    def _step_scheduler(self) -> None:
        """The one place a step runs, for `step` and `run` alike."""
        try:
            self.scheduler.step()
        finally:
            self.profiler.on_step()

    # -- profiling (driver.profiling; with tensor parallelism, rank 0's steps) ---------------------
    def start_profile(self, output_dir: str | None = None, num_steps: int | None = None) -> str:
        """Record the next steps (`num_steps`, or until `stop_profile`); returns the trace's folder."""
        return self.profiler.start(output_dir, num_steps)

    def stop_profile(self) -> concurrent.futures.Future[ProfileReport]:
        """End the profile (`ProfileError` if none ran): its report once its trace is written, on a
        thread of its own (wait for it off the stepping thread)."""
        return self.profiler.stop()

    # -- a run of its own (a command, a benchmark) ------------------------------------------
    def submit(self, adds: Iterable[Add]) -> list[Request]:
        """Queue requests on this rank's scheduler now, as a turn's `Add`s are; returns them in
        order. Raises `InvalidRequest` at the first that cannot run (those before it stay queued)."""
        scheduler = self.scheduler
        return [scheduler.add_request(add.rid, add.input_ids, add.sampling) for add in adds]

    def run(
        self,
        *,
        intake: Callable[[int], bool] | None = None,
        until: Callable[[int], bool] | None = None,
    ) -> int:
        """Step until the scheduler has no work and `intake` expects no more; returns the steps run.
        Outputs leave through the scheduler's callback and accumulate on the `Request`s `submit`
        returned.

        The synchronous loop of a caller that holds the core alone (`snugkv generate` and `chat`,
        the benchmarks that run requests in process). It takes no turn: nothing is shared (with
        tensor parallelism every rank runs the same program and submits the same requests itself),
        no memory check or expiry is added, and a failed step raises here, on the rank where it
        failed (with `--tp` that ends the launch), instead of being agreed on as in `step`: the
        loop adds no collective to a step.

        `intake(steps)` runs before each step (`steps`: how many ran so far) and, while it expects
        more, while the scheduler is idle too; it may submit, abort, resize or wait, and returns
        whether more requests may still come. `until(steps)` ends the run before the next step,
        work or not (a benchmark's window of steps).
        """
        scheduler = self.scheduler
        steps, more = 0, intake is not None
        while more or scheduler.has_work:
            if until is not None and until(steps):
                break
            if intake is not None:
                more = intake(steps)
                if not scheduler.has_work:
                    continue
            self._step_scheduler()
            steps += 1
        return steps

    # -- what drivers report (this rank's view; no collective) --------------------------------
    def kv_info(self) -> KvInfo:
        """GET /kv: the KV cache now, what the requests hold and what a resize would need (read
        between steps: it walks the queues)."""
        return elastic.kv_info(self.scheduler, self.engine)

    def sleep_state(self) -> SleepState:
        return self.engine.sleep_state()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def metrics_snapshot(self) -> MetricsSnapshot:
        engine = self.engine
        return MetricsSnapshot(
            stats=self.scheduler.stats(),
            kv_max_total_num_tokens=engine.kv.committed_tokens,
            kv_committed_bytes=engine.pool.committed_bytes,
            kv_resizes=engine.kv_event_count,
            sleep_level=engine.sleep_level if engine.is_sleeping else 0,
            kv_pressure_shrinks=engine.kv.pressure_shrinks,
            kv_pressure_grows=engine.kv.pressure_grows,
            oom_retries=self.scheduler.oom_retries,
        )

    def memory_report(self) -> MemoryReport:
        """The start-up sizing report (updated by every resize) and the KV cache's slots now."""
        allocator = self.scheduler.runner.allocator
        return MemoryReport(
            sizing=self.engine.report,
            capacity_tokens=allocator.capacity_tokens,
            free_tokens=allocator.available_tokens,
            prefix_cache_tokens=self.scheduler.cache.cached_tokens,
        )

    def info(
        self,
        *,
        model_name: str,
        step_errors: int,
        aborted_rids: tuple[str, ...],
        slot_accounting: SlotAccounting,
    ) -> EngineInfo:
        """GET /server_info, with the driver's own counters."""
        engine, scheduler = self.engine, self.scheduler
        args = engine.args
        step_times = scheduler.times.as_dict()
        del step_times["device_idle_fraction"]  # over the whole life of the engine: meaningless
        return EngineInfo(
            model=model_name,
            startup=engine.report,
            page_size=scheduler.page_size,
            kv_layout=args.cache.kv_layout,
            kv_dtype=str(engine.kv_dtype),
            attention_backend=args.runner.attention_backend,
            tp_size=self.tp.world_size,
            context_length=engine.context_length,
            chunked_prefill_size=scheduler.chunked_prefill_size,
            cuda_graph_max_bs=args.runner.decode_graph_max_bs,
            prefill_graph_max_tokens=args.runner.prefill_graph_tokens,
            overlap_schedule=scheduler.overlap,
            device=str(engine.device),
            kv_capacity_tokens=scheduler.runner.allocator.capacity_tokens,
            kv_max_capacity_tokens=None
            if scheduler.could_hold_tokens is None
            else scheduler.could_hold_tokens,
            stats=scheduler.stats(),
            step_times=step_times,
            step_errors=step_errors,
            gc=GC_PAUSES.as_dict(),
            is_sleeping=engine.is_sleeping,
            kv_events=tuple(engine.kv_events),
            aborted_rids=aborted_rids,
            slot_accounting_when_idle=slot_accounting,
        )

    def close(self) -> None:
        """Release the engine's graphs, KV arena and weights; idempotent."""
        self.engine.close()
