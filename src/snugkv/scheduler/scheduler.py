"""Continuous batching over one model runner.

Every step either prefills (new requests and chunks of long prompts, up to a token budget) or
decodes every running request by one token (through the decode CUDA graphs). A prefill step is
mixed: the running requests decode in it too, their rows ahead of the prompt chunks, so a prompt
that arrives does not stop them for a step (`_schedule_prefill` says when it is not). New requests
join at every step. Memory: admission only takes what is free after evicting the prefix cache, keeps
one page per running request in reserve, and when decode still runs short, the newest request
is retracted (its KV goes to the prefix cache, it waits to be recomputed) — never a crash, never
a dropped request. After any workload every slot is back: `check_slot_accounting()`.

The scheduler runs on one thread (the engine's loop); it never blocks on I/O. Outputs leave
through the `on_output` callback. This module is the policy (who runs, when a request ends); the
slots' life is `scheduler.slots`, what leaves is `scheduler.outputs`, a step on its way is
`scheduler.launched`.

Overlapped scheduling (on unless `overlap=False`, `--disable-overlap-schedule`): a step is
launched (forward and sampling queued on the device, tokens on their way to pinned host memory)
and its results are read one `step()` later, after the next step is queued, so the GPU runs
step N+1 while the host moves step N's requests on (stop checks, stop strings, detokenizing,
outputs, freeing). What does not depend on the sampled tokens happens at launch: `in_flight`
counts a request's launched tokens (their slots lie past `kv_len`, so a release frees them), a
prefilled request joins `running`, a non-final chunk goes back to `waiting`. The next decode
batch is built from that state: a request whose token is still on the device gets
`FUTURE_TOKEN`, which the runner fills in on the device from what the sampler stored. A request
that ends at step N is already in step N+1: that extra token is never read, and its slots go
back once step N+1 is read (`RequestSlots.release` holds them back until then: the device may still
write them, and a host-tier load into free slots does not wait for the device's queued work); a
request aborted meanwhile is skipped and held back alike.

A prefill is launched while step N runs too: the waiting requests are admitted on what step N
leaves (a request that ends in N frees its slots two steps later), and a prompt whose chunk is in
flight continues at `kv_len + in_flight`. The host reads step N before launching (a synchronous
step) only when nothing can be launched without it: no prefill fits and the decode batch would
need a retraction (which must choose among the requests step N leaves running). Overlapped or
not, every request is fed the same tokens, so greedy and seeded outputs are the same; what may
differ is the step at which a waiting request is admitted (one later at most) and, under memory
pressure, which prefix-cache entries are evicted. With tensor parallelism the sampled tokens go
from rank 0 to the others over the device group (`ModelRunner.sample_on_device`), so every
rank overlaps alike and makes the same choices.

A step whose launch runs out of device memory (another process took what the activations needed)
is retried smaller instead of failing its requests (`retry_out_of_memory`, one rank only: with
tensor parallelism the other ranks are inside the step's collectives). The step before it is read,
every request of the failed batch is retracted (its computed KV goes to the prefix cache, nothing
is lost; the failed launch's slots go with the release), and until `OOM_RECOVERY_STEPS` steps ran
the batches are capped at half the failed one's rows (and a failed prefill's tokens), doubling
back after each such run. Every library's way of saying so counts (`memory.no_memory`: torch,
cuBLAS, the CUDA driver, NCCL, the arena). Past `MAX_OOM_STREAK` failures in a row the requests of
the failed batch end with a 503 and Retry-After (the engine stays up; the others go on).

A prompt longer than the KV cache holds now, but not longer than it could hold (`could_hold_tokens`:
the reserve and the caps of an engine that can resize), waits for memory instead of being refused:
it stays queued without holding a slot, the requests behind it are admitted past it, and once the
cache grew (memory pressure eased, a resize, the memory share) it is admitted as any other. The
engine core ends it with a 503 and Retry-After when `--queue-timeout` passes first (`expire_wait`).
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

from snugkv.core.forward import FUTURE_TOKEN, BatchRow
from snugkv.core.reports import SchedulerStats
from snugkv.core.sampling import PROMPT_LOGITS_PER_STEP, InvalidRequest, SamplingParams
from snugkv.core.structured_output import TokenBitmask
from snugkv.core.tokenizer import Tokenizer
from snugkv.core.transfer import to_host
from snugkv.memory.host_tier import HostKvTier
from snugkv.runner.model_runner import ModelRunner
from snugkv.scheduler.launched import LaunchedStep, ScheduledBatch, StepTimes, clock
from snugkv.scheduler.oom_recovery import MAX_OOM_STREAK, OOM_RETRY_AFTER_S, OutOfMemoryRecovery
from snugkv.scheduler.outputs import OutputBuilder, OutputCallback
from snugkv.scheduler.prompt_scores import split_logits
from snugkv.scheduler.radix_cache import RadixCache
from snugkv.scheduler.request import Request
from snugkv.scheduler.slots import RequestSlots, SlotAccountingError
from snugkv.scheduler.speculation import Speculation
from snugkv.scheduler.stops import stop_limits, stop_reason
from snugkv.speculative.config import SpeculativeConfig
from snugkv.structured.bitmask import fill_token_bitmask
from snugkv.structured.grammars import GrammarCache, grammar_cache_for
from snugkv.structured.matcher import RequestGrammar

__all__ = ["OutputCallback", "Scheduler", "SlotAccountingError"]

logger = logging.getLogger(__name__)


class _ReadFirst(enum.Enum):
    """A speculating step's drafts rest on guesses that fail too often: read the step in flight."""

    READ_FIRST = enum.auto()


READ_FIRST = _ReadFirst.READ_FIRST


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        tokenizer: Tokenizer | None = None,
        eos_token_ids: Iterable[int] = (),
        max_running_requests: int,
        chunked_prefill_size: int,
        enable_prefix_cache: bool = True,
        on_output: OutputCallback | None = None,
        overlap: bool = True,
        mixed: bool = True,
        request_cap: Callable[[], int] | None = None,
        host_tier: HostKvTier | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        """`max_running_requests` is this scheduler's own limit; `request_cap` reads the engine's
        limit for the KV cache's size now (its one owner: the KV sizing's recap, which every resize,
        pressure move and wake updates), and the lower of the two holds. `host_tier`: where the
        prefix cache keeps what leaves the device (None: it is dropped). `speculative`: decode
        steps speculate with this config (`scheduler.speculation`); None: they never do. `mixed`:
        a prefill step takes the running requests' decode rows along (`_schedule_prefill`)."""
        self.runner = runner
        self.overlap = overlap
        self.mixed = mixed
        self.eos_token_ids = frozenset(eos_token_ids)
        runner.sampler.eos_token_ids = tuple(sorted(self.eos_token_ids))  # what min_tokens holds back
        self.request_limit = max_running_requests
        self._request_cap = request_cap
        self.chunked_prefill_size = chunked_prefill_size
        self.page_size = runner.allocator.page_size
        self.context_length = runner.max_context_len
        self.cache = RadixCache(runner.allocator, enabled=enable_prefix_cache, host_tier=host_tier)
        self.slots = RequestSlots(runner, self.cache)
        self.outputs = OutputBuilder(tokenizer, on_output)
        # every rank must pause the same rows: step times differ between ranks, so there the
        # back-off keeps a fixed break-even
        self.speculation = (
            Speculation(speculative, measure_costs=not runner.tp.enabled) if speculative is not None else None
        )
        self.outputs.reports_drafts = self.speculation is not None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_retractions = 0
        self.generated_tokens = 0
        self.times = StepTimes()
        self._arrivals = itertools.count()
        self.paused = False  # the engine sleeps: requests wait in the queue and no step runs
        self._in_flight: LaunchedStep | None = None  # launched; its results are not read yet
        self._grammars: GrammarCache | None = None  # structured output's, made on first use
        self.oom = OutOfMemoryRecovery()  # a launch out of device memory is retried smaller
        # What the KV cache could grow to (an engine that can resize); None: its size is fixed.
        self.could_hold_tokens: int | None = None

    @property
    def retry_out_of_memory(self) -> bool:
        """A launch out of device memory is retried smaller (off with tensor parallelism)."""
        return self.oom.enabled

    @retry_out_of_memory.setter
    def retry_out_of_memory(self, enabled: bool) -> None:
        self.oom.enabled = enabled

    @property
    def oom_retries(self) -> int:
        """Launches that ran out of device memory and were retried smaller, since start."""
        return self.oom.retries

    @property
    def max_running_requests(self) -> int:
        """The most requests a step runs: the lower of this scheduler's limit and the engine's cap."""
        if self._request_cap is None:
            return self.request_limit
        return min(self.request_limit, self._request_cap())

    # -- intake -----------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], sampling: SamplingParams) -> Request:
        """Queue a request; raises `InvalidRequest` (nothing queued) when it cannot run."""
        self.check_request(prompt_ids, sampling)
        if rid in self.requests:
            raise InvalidRequest(f"request id {rid!r} is already in use")
        request = Request(rid, list(prompt_ids), sampling, seq=next(self._arrivals))
        if sampling.prompt_logprobs is not None:
            request.prompt_logprobs.append(None)  # the first token has nothing before it
        request.generator = sampling.make_generator(self.runner.device)
        if sampling.structured is not None:
            request.grammar = RequestGrammar(self._grammar_cache().get(sampling.structured))
        self.requests[rid] = request
        self.waiting.append(request)
        return request

    def check_request(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Raise `InvalidRequest`, saying what to change, if this prompt cannot run here; changes
        nothing (a batch can be checked whole before any of it is queued)."""
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty; send at least one token", param="prompt")
        sampling.validate(self.context_length)
        sampling.check_token_ids(self.runner.model.config.vocab_size)
        if len(prompt_ids) + 1 > self.context_length:
            raise InvalidRequest(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.context_length} "
                "(prompt plus at least one new token); shorten the prompt",
                param="prompt",
            )
        capacity = self.runner.allocator.capacity_tokens
        if len(prompt_ids) + self.page_size > capacity and not self.paused:  # asleep: wake checks it
            could_hold = self.could_hold_tokens
            if could_hold is None:
                raise InvalidRequest(
                    f"the prompt needs {len(prompt_ids)} KV slots but the whole KV cache holds {capacity}; "
                    "shorten the prompt",
                    param="prompt",
                )
            if len(prompt_ids) + self.page_size > could_hold:  # it waits for memory when it fits this
                raise InvalidRequest(
                    f"the prompt needs {len(prompt_ids)} KV slots but the KV cache can hold at most {could_hold} "
                    f"(its reserved address space and caps; it holds {capacity} now); shorten the prompt",
                    param="prompt",
                )
        if sampling.structured is not None:
            self._grammar_cache().get(sampling.structured)  # compiled once; a bad spec is refused here

    def _grammar_cache(self) -> GrammarCache:
        if self._grammars is None:
            tokenizer = self.outputs.tokenizer
            if tokenizer is None:
                raise InvalidRequest(
                    "structured output needs the model's tokenizer, and this engine has none"
                )
            self._grammars = grammar_cache_for(
                tokenizer.hf, self.runner.model.config.vocab_size, self.eos_token_ids
            )
        return self._grammars

    def abort(self, rid: str) -> None:
        """Mark a request aborted; its slots are freed at the start of the next step. Idempotent."""
        request = self.requests.get(rid)
        if request is not None:
            request.aborted = True

    def waits_for_memory(self, request: Request) -> bool:
        """A queued request the KV cache of now cannot hold (it could once the cache grows)."""
        return (
            not request.is_admitted
            and request.num_tokens + self.page_size > self.runner.allocator.capacity_tokens
        )

    @property
    def only_waits_for_memory(self) -> bool:
        """Work, but none a step can do: every queued request waits for memory, nothing runs."""
        return (
            not self.running
            and self._in_flight is None
            and all(self.waits_for_memory(r) for r in self.waiting)
        )

    def expire_wait(self, rid: str, retry_after_s: float) -> None:
        """End a request that waited for memory in vain (a 503 with Retry-After); one admitted
        meanwhile, or gone, is left alone."""
        request = self.requests.get(rid)
        if request is None or request not in self.waiting or not self.waits_for_memory(request):
            return
        capacity = self.runner.allocator.capacity_tokens
        request.retry_after_s = retry_after_s
        self.fail(
            request,
            f"the prompt needs {request.num_tokens} KV slots and the KV cache holds {capacity} now: no memory "
            "came back while it waited (another process holds the device's memory); try again later",
        )

    @property
    def has_work(self) -> bool:
        return (not self.paused and bool(self.waiting or self.running)) or self._in_flight is not None

    # -- one step -----------------------------------------------------------------------
    def step(self) -> None:
        """Launch the next step, then read the results of the step before it (overlapped); or
        read the step in flight first, then launch (synchronous). A step that raised leaves the
        scheduler to `fail_all`."""
        self._drop_aborted()
        if self.paused:  # asleep: only the step already launched is read
            self.finish_in_flight()
            return
        previous, batch = self._in_flight, None
        try:
            if previous is not None and self.overlap:  # schedule while the device runs `previous`
                batch = self._schedule_prefill() if self._prefill_may_run() else None
                # a draft model's drafts need `previous`'s tokens: such a step reads it first
                # (so does one whose rows guess `previous`'s tokens poorly: None from the decode)
                if batch is None and (self._drafts_in_flight() or not self._may_speculate()):
                    batch = self._schedule_decode(retract=False)
            if batch is None:
                self.finish_in_flight()
                previous = None
                batch = self._schedule_prefill() or self._schedule_decode(retract=True)
                if batch is None:
                    return
            try:
                launched = self._launch(batch, previous)
            except Exception as exc:
                if self.oom.may_retry(exc):
                    self._retry_smaller(batch, exc)
                    return
                if self.oom.handles(exc):
                    self._refuse_for_memory(batch, exc)
                    return
                raise
            self._in_flight = launched
            self.slots.launched(id(launched), batch.requests)
            self.oom.launched(self.max_running_requests, self.chunked_prefill_size)
            if previous is not None:
                if self.speculation is not None and batch.drafts is None and previous.running():
                    self.speculation.build_ahead(self.running)  # while the device is still busy
                self._complete(previous)
            if not self.overlap or batch.drafts is not None:  # a verify step is read at once
                self.finish_in_flight()
        except Exception:
            self._requeue_after_failure(batch.requests if batch is not None else [])
            raise

    def finish_in_flight(self) -> None:
        """Read the results of the step in flight, if any, and move its requests on. Anything
        that changes slots or the KV pool behind the scheduler's back calls this first."""
        launched, self._in_flight = self._in_flight, None
        if launched is not None:
            self._complete(launched)

    def _prefill_may_run(self) -> bool:
        return bool(self.waiting) and len(self.running) < self._row_limit()

    def _may_speculate(self) -> bool:
        speculation = self.speculation
        return speculation is not None and speculation.may_speculate(self.running, self.context_length)

    def _drafts_in_flight(self) -> bool:
        return self.speculation is not None and self.speculation.drafts_in_flight

    # -- running out of device memory ---------------------------------------------------
    def _row_limit(self) -> int:
        """Requests that may run at once: the flag's (re-capped) limit, or less after running out."""
        return self.oom.row_limit(self.max_running_requests)

    def _retry_smaller(self, batch: ScheduledBatch, error: Exception) -> None:
        """The launch of `batch` ran out of memory: read the step before it, retract every request
        of the batch (the release frees the failed launch's slots too) and cap what runs next."""
        self.finish_in_flight()
        self._requeue_after_failure(batch.requests)
        for request in sorted(batch.requests, key=lambda r: -r.seq):
            if not request.finished:
                self.retract(request)
        # a decode ran out for its rows; a prefill for its tokens too
        tokens = (
            self.chunked_prefill_size
            if batch.decode
            else max(self.page_size, sum(len(row.token_ids) for row in batch.rows) // 2)
        )
        self.oom.retried(len(batch.requests), tokens)
        rows = self.oom.row_limit(len(batch.requests))
        logger.warning(
            "a %s step of %d requests ran out of device memory (%s); retracted them, retrying with at most "
            "%d requests and %d tokens per step",
            "decode" if batch.decode else "prefill",
            len(batch.requests),
            error,
            rows,
            tokens,
        )

    def _refuse_for_memory(self, batch: ScheduledBatch, error: Exception) -> None:
        """`MAX_OOM_STREAK` launches in a row found no memory: end the failed batch's requests with
        a 503 and Retry-After (the client may try again; it is not the request's fault) and let the
        rest go on, the batch caps kept."""
        self.oom.refused()
        self.finish_in_flight()
        self._requeue_after_failure(batch.requests)
        logger.warning(
            "%d launches in a row ran out of device memory (%s); ended %d requests with a 503",
            MAX_OOM_STREAK,
            error,
            len(batch.requests),
        )
        for request in batch.requests:
            if not request.finished:
                request.retry_after_s = OOM_RETRY_AFTER_S
                self.fail(
                    request,
                    "the device has no memory for this request's step now (another process holds it); "
                    "try again later",
                )

    def _requeue_after_failure(self, batch: list[Request]) -> None:
        """After a step raised: every request of the batch that did not finish is in a queue again
        (so `fail_all` reaches it), and no finished one is left in `running`."""
        self.running = [request for request in self.running if not request.finished]
        queued = {id(request) for request in (*self.waiting, *self.running)}
        for request in batch:
            if not request.finished and id(request) not in queued:
                self.waiting.appendleft(request)

    def _drop_aborted(self) -> None:
        for queue in (self.waiting, self.running):
            for request in [r for r in queue if r.aborted]:
                queue.remove(request)
                self._finish(request, "abort")

    def _schedule_prefill(self) -> ScheduledBatch | None:
        """The next chunk of prompt tokens of the waiting requests, first come first served, up to the
        chunk budget. A request whose earlier chunk is still in flight (overlap) continues after it.
        Room is counted in pages as requests are taken; the slots of the whole batch are allocated
        in one call at the end (one call per request cost ~0.5 ms of host time each).

        A mixed step (`self.mixed`): every running request decodes in the same step, its row ahead
        of the prompt chunks, and the chunks take what is left of the token budget; so a prompt
        arriving never stops the running requests for a step. Not mixed: a step that speculates
        next (its drafts need the last tokens on the host), decode rows that would take over half
        the budget, or decode rows the pool has no room for (the decode step retracts)."""
        budget = self.oom.token_limit(self.chunked_prefill_size)
        row_limit = self._row_limit()
        scoring_budget = PROMPT_LOGITS_PER_STEP
        rows: list[BatchRow] = []
        batch: list[Request] = []
        admitted_here: list[bool] = []
        taken = 0  # slots the rows taken so far will take
        reserve = len(self.running) * self.page_size
        if self._mixes(budget):
            rows = self._decode_rows(self.running)
            batch = list(self.running)
            decode_slots = sum(self.slots.new_slots(row.prefix_len, 1) for row in rows)
            if self.slots.make_room(decode_slots + reserve):
                taken, budget = decode_slots, budget - len(rows)
            else:
                rows, batch = [], []
        decode_rows = len(rows)
        waiting_for_memory: list[Request] = []  # passed over: they go back to the queue's head in order
        while self.waiting and budget > 0 and len(self.running) + len(batch) - decode_rows < row_limit:
            request = self.waiting[0]
            if self.waits_for_memory(request):
                waiting_for_memory.append(self.waiting.popleft())
                continue
            newly_admitted = not request.is_admitted
            if newly_admitted and not self.slots.admit(request):
                break
            scoring = request.scores_prompt
            start = request.launched_len
            chunk = min(request.num_tokens - start, budget, scoring_budget if scoring else budget)
            new_slots = self.slots.new_slots(start, chunk) if chunk > 0 else 0
            if chunk <= 0 or not self.slots.make_room(taken + new_slots + self.page_size + reserve):
                if newly_admitted:
                    self.slots.release(request)
                break
            end = start + chunk
            rows.append(
                BatchRow(
                    request.table_row,
                    start,
                    request.all_ids[start:end],
                    need_logits=end == request.num_tokens,
                    prompt_logits=scoring,
                )
            )
            self.waiting.popleft()
            batch.append(request)
            admitted_here.append(newly_admitted)
            taken += new_slots
            budget -= chunk
            scoring_budget -= chunk if scoring else 0
            reserve += self.page_size
        slots = self.runner.allocate_slots(rows) if len(rows) > decode_rows else None
        while slots is None and len(rows) > decode_rows:  # the pool counts differently (a window sub-pool)
            rows.pop()
            request = batch.pop()
            if admitted_here.pop():
                self.slots.release(request)
            self.waiting.appendleft(request)
            slots = self.runner.allocate_slots(rows) if len(rows) > decode_rows else None
        self.waiting.extendleft(reversed(waiting_for_memory))
        if slots is None:  # no prompt chunk fits: the running requests decode on their own
            return None
        return ScheduledBatch(rows, batch, slots, decode=False, decode_rows=decode_rows)

    def _mixes(self, budget: int) -> bool:
        """Whether this prefill step takes the running requests' decode rows along."""
        return (
            self.mixed
            and bool(self.running)
            and len(self.running) * 2 <= budget
            and not self._may_speculate()
        )

    @staticmethod
    def _decode_rows(requests: list[Request]) -> list[BatchRow]:
        """A row of one token per request: its last token, or `FUTURE_TOKEN` when that token is
        still on the device (a step in flight sampled it)."""
        return [
            BatchRow(r.table_row, r.kv_len + r.in_flight, [FUTURE_TOKEN] if r.in_flight else [r.last_token])
            for r in requests
        ]

    def _schedule_decode(self, *, retract: bool) -> ScheduledBatch | None:
        """Every running request by one token. A request whose last token is still on the device
        (a step in flight) reads it there (`FUTURE_TOKEN`). When the pool runs short: retract the
        newest request and try again, or (`retract=False`) give up and return None. A step that
        speculates (`_schedule_verify`) is tried first; without room for its drafts it is an
        ordinary decode step; None too where its drafts should wait for the step in flight."""
        while self.running:
            verify = self._schedule_verify() if self._may_speculate() else None
            if verify is READ_FIRST:  # the caller reads the step in flight, then schedules again
                return None
            if verify is not None:
                return verify
            rows = self._decode_rows(self.running)
            self.slots.make_room(len(rows) * self.page_size)
            slots = self.runner.allocate_slots(rows)
            if slots is not None:
                return ScheduledBatch(rows, list(self.running), slots, decode=True)
            if not retract:
                return None
            self._retract(max(self.running, key=lambda r: r.seq))  # the newest; never wall time
        return None

    def _schedule_verify(self) -> ScheduledBatch | _ReadFirst | None:
        """Every running request by its last token and its draft (`scheduler.speculation`), or None
        where no request drafts or the pool has no room for the drafts. A request whose last token
        a step in flight computes (`in_flight`) takes it on the device (`FUTURE_TOKEN`), as a
        decode row does, its draft behind it; `READ_FIRST` where such drafts rest on guesses that
        have failed too often of late (`Speculation.reads_first`)."""
        assert self.speculation is not None
        requests = list(self.running)
        drafts = self.speculation.drafts(requests, self.context_length)
        if not any(drafts):
            return None
        if self.speculation.reads_first(requests, drafts):
            return READ_FIRST
        rows = [
            BatchRow(
                r.table_row,
                r.kv_len + r.in_flight,
                [FUTURE_TOKEN if r.in_flight else r.last_token, *draft],
                draft_len=len(draft),
            )
            for r, draft in zip(requests, drafts)
        ]
        needed = sum(self.slots.new_slots(row.prefix_len, len(row.token_ids)) for row in rows)
        if not self.slots.make_room(needed + len(rows) * self.page_size):
            return None
        slots = self.runner.allocate_slots(rows)
        if slots is None:
            return None
        return ScheduledBatch(rows, requests, slots, decode=True, drafts=drafts)

    def retract(self, request: Request) -> None:
        """Give back an admitted request's slots now, its computed KV to the prefix cache, so that
        it is computed again later: a running one goes to the head of the queue, one whose prompt
        is partly computed keeps its place there. Nothing is lost (elastic memory makes room so)."""
        if request in self.running:
            self._retract(request)
        else:
            self.slots.release(request)

    def fail(self, request: Request, message: str) -> None:
        """End a queued or running request now with `message` (finish_reason "error")."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.error = message
        self._finish(request, "error")

    def _retract(self, request: Request) -> None:
        """Free a running request's KV (to the prefix cache) and queue it to be recomputed."""
        self.running.remove(request)
        self.slots.release(request)
        request.retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(request)
        logger.warning(
            "KV cache full: retracted request %s (%d tokens); it will be recomputed",
            request.rid,
            request.num_tokens,
        )

    # -- running a batch --------------------------------------------------------------
    def _launch(self, scheduled: ScheduledBatch, previous: LaunchedStep | None) -> LaunchedStep:
        """Queue the forward and the sampling, start the tokens' copy to the host, and move on what
        does not depend on them: the new tokens are in flight, a prefilled request runs from now
        on (a non-final chunk waits for the next). `previous` is the step still unread (overlap)."""
        rows, batch = scheduled.rows, scheduled.requests
        for row, request in zip(rows, batch):
            request.in_flight += len(row.token_ids)
        device = self.runner.device
        started = clock(device)
        draft_probs = None
        if scheduled.drafts is not None and self.speculation is not None:  # a draft model drafts now
            draft_probs = self.speculation.draft_on_device(self.runner, scheduled)
        logits, prompt_scores = split_logits(self.runner.forward(rows, scheduled.slots), rows, batch)
        if scheduled.drafts is not None:
            return self._launch_verify(scheduled, logits, started, draft_probs, previous)
        sampled_rows = [index for index, row in enumerate(rows) if row.need_logits]
        tokens = log_probs = None
        if sampled_rows:
            sampled = [batch[index] for index in sampled_rows]
            tokens = self.runner.sample_on_device(
                logits,
                [r.sampling for r in sampled],
                [r.generator for r in sampled],
                [r.table_row for r in sampled],
                # after a prefill, the penalties' token history starts from the request's tokens
                history_starts=() if scheduled.decode else self._history_starts(scheduled, sampled_rows),
                token_bitmask=self._token_bitmask(sampled, previous),
            )
            log_probs = self.outputs.log_prob_rows(logits, sampled)
        launched = LaunchedStep(
            scheduled,
            sampled_rows,
            tokens=None if tokens is None else to_host(tokens),
            log_probs=None if log_probs is None else to_host(log_probs),
            started=started,
            overlapped=previous is not None,
            prompt_scores=prompt_scores,
        )
        launched.finish_launch(device)
        if not scheduled.decode:  # a mixed step's decode rows are running already
            for row, request in zip(rows[scheduled.decode_rows :], batch[scheduled.decode_rows :]):
                if row.need_logits:
                    self.running.append(request)
                else:
                    self.waiting.appendleft(request)  # the rest of its prompt comes next step
        return launched

    @staticmethod
    def _history_starts(
        scheduled: ScheduledBatch, sampled_rows: list[int]
    ) -> list[tuple[list[int], list[int]] | None]:
        """Per sampled row of a prefill step, where its penalties' token history starts: the
        request's prompt and output so far; None for a mixed step's decode rows (theirs runs on)."""
        requests = scheduled.requests
        return [
            None
            if index < scheduled.decode_rows
            else (requests[index].prompt_ids, requests[index].output_ids)
            for index in sampled_rows
        ]

    def _launch_verify(
        self,
        scheduled: ScheduledBatch,
        logits: torch.Tensor,
        started: Any,
        draft_probs: torch.Tensor | None,
        previous: LaunchedStep | None,
    ) -> LaunchedStep:
        """The rest of `_launch` for a speculative step: verification in place of sampling (with a
        draft model's `draft_probs`), and the log-probabilities of every position of the rows that
        asked (each emitted token's is read)."""
        batch, drafts = scheduled.requests, scheduled.drafts
        assert drafts is not None
        verification = self.runner.verify_on_device(
            logits,
            drafts,
            [r.sampling for r in batch],
            [r.generator for r in batch],
            [r.table_row for r in batch],
            token_bitmask=self._token_bitmask(batch, previous, positions=_first_positions(drafts)),
            draft_probs=draft_probs,
        )
        log_probs = self.outputs.log_prob_rows(logits, _per_position(batch, drafts))
        verified = torch.cat([verification.accepted_lens[:, None], verification.token_ids], dim=1)
        launched = LaunchedStep(
            scheduled,
            list(range(len(batch))),
            tokens=None,
            log_probs=None if log_probs is None else to_host(log_probs),
            started=started,
            overlapped=previous is not None,
            verified=to_host(verified),
        )
        launched.finish_launch(self.runner.device)
        return launched

    def _token_bitmask(
        self, sampled: list[Request], previous: LaunchedStep | None, positions: list[int] | None = None
    ) -> TokenBitmask | None:
        """The tokens structured output allows in this step's constrained rows (None: there are none).

        A constrained row's mask follows from its last token. Under overlap that token may still be
        on its way from the step before (`previous`): the mask waits for that step's tokens, which
        the device has computed by now or soon (this step's forward is already queued behind them),
        and feeds them to the matchers early; `_complete` then finds them fed. Unconstrained rows
        and batches wait for nothing. `positions`: the logits row of each sampled row, where it is
        not its index (a verify step: a row with a draft has several)."""
        constrained = [(index, r.grammar) for index, r in enumerate(sampled) if r.grammar is not None]
        if not constrained:
            return None
        pending: dict[int, int] = {}
        if previous is not None:
            tokens, _ = previous.results()
            previous_batch = previous.batch.requests
            for token, index in zip(tokens, previous.sampled_rows):
                pending[id(previous_batch[index])] = token
        for index, grammar in constrained:
            output_ids = sampled[index].output_ids
            unread = pending.get(id(sampled[index]))
            grammar.advance(output_ids if unread is None else [*output_ids, unread])
        rows = [index if positions is None else positions[index] for index, _ in constrained]
        grammars = [grammar for _, grammar in constrained]
        return fill_token_bitmask(grammars, rows, self.runner.model.config.vocab_size, self.runner.device)

    def _complete(self, launched: LaunchedStep) -> None:
        """Read a launched step's tokens and move each of its requests on; a request that ended
        while the step ran (it ended a step earlier, or was aborted) is skipped."""
        if launched.verified is not None:
            self._complete_verify(launched)
            return
        tokens, log_probs = launched.results()
        self.slots.read_back(id(launched))
        self._add_times(launched)
        rows, batch = launched.batch.rows, launched.batch.requests
        sampled = [batch[index] for index in launched.sampled_rows]
        logprobs = self.outputs.logprobs(log_probs, sampled, tokens)
        if launched.prompt_scores is not None:
            launched.prompt_scores.add_to_requests(self.outputs.piece)
        now = time.monotonic()
        finished_any = False
        sample_index = 0
        emit, stop_reason = self.outputs.emit, self._stop_reason
        limits = self._stop_limits()
        for row, request in zip(rows, batch):
            index = sample_index
            sample_index += row.need_logits
            if request.finished:
                continue
            request.kv_len += len(row.token_ids)
            request.in_flight -= len(row.token_ids)
            if not row.need_logits:
                continue
            if request.sampling.max_new_tokens == 0:  # only scoring the prompt: nothing is generated
                finished_any = True
                self._finish(request, "length")
                continue
            request.output_ids.append(tokens[index])
            if request.grammar is not None:
                request.grammar.advance(request.output_ids)
            if logprobs[index] is not None:
                request.logprobs.append(logprobs[index])
            request.first_token_s = request.first_token_s or now
            self.generated_tokens += 1
            reason = stop_reason(request, limits)
            if reason:
                finished_any = True
                self._finish(request, reason)
            else:
                emit(request)
        if finished_any:
            self.running = [request for request in self.running if not request.finished]

    def _add_times(self, launched: LaunchedStep) -> None:
        """Count a step read back; speculation's back-off learns its step costs from it."""
        self.times.add(launched)
        if self.speculation is not None:
            self.speculation.costs.observe(self.times.records[-1])

    def _complete_verify(self, launched: LaunchedStep) -> None:
        """Read a verify step and move each request on by the tokens it emitted, one at a time:
        each is checked for a stop as a sampled token is, and the first stop ends the request there
        (the tokens after it are dropped). The request keeps KV for its last token and the draft
        tokens it kept before its newest token; the slots of the rest go back."""
        emitted = launched.emitted()
        _, log_probs = launched.results()
        self.slots.read_back(id(launched))
        self._add_times(launched)
        speculation = self.speculation
        assert speculation is not None and launched.batch.drafts is not None
        rows, batch, drafts = launched.batch.rows, launched.batch.requests, launched.batch.drafts
        position_requests = _per_position(batch, drafts)
        position_tokens = [
            tokens[j] if j < len(tokens) else 0
            for draft, tokens in zip(drafts, emitted)
            for j in range(len(draft) + 1)
        ]
        logprobs = self.outputs.logprobs(log_probs, position_requests, position_tokens)
        now = time.monotonic()
        limits = self._stop_limits()
        finished_any = False
        for row, request, draft, tokens, first in zip(rows, batch, drafts, emitted, _first_positions(drafts)):
            if request.finished:
                continue
            fed_before = request.kv_len
            request.in_flight -= len(row.token_ids)
            speculation.record(request, len(draft), len(tokens) - 1)
            reason = None
            for offset, token in enumerate(tokens):
                request.output_ids.append(token)
                request.kv_len = fed_before + offset + 1  # KV up to the token before the newest
                if request.grammar is not None:
                    request.grammar.advance(request.output_ids)
                if logprobs[first + offset] is not None:
                    request.logprobs.append(logprobs[first + offset])
                self.generated_tokens += 1
                reason = self._stop_reason(request, limits)
                if reason:
                    break
            self.slots.release_rejected(request, fed_before + len(row.token_ids))
            request.first_token_s = request.first_token_s or now
            if reason:
                finished_any = True
                self._finish(request, reason)
            else:
                self.outputs.emit(request)
        if finished_any:
            self.running = [request for request in self.running if not request.finished]

    def _stop_limits(self) -> tuple[int, int]:
        kv_tokens = self.could_hold_tokens or self.runner.allocator.capacity_tokens
        return stop_limits(self.context_length, kv_tokens, self.page_size)

    def _stop_reason(self, request: Request, limits: tuple[int, int]) -> str | None:
        return stop_reason(request, limits, self.eos_token_ids, self.outputs.tokenizer)

    # -- leaving ------------------------------------------------------------------------
    def _finish(self, request: Request, reason: str) -> None:
        self.slots.release(request, ending=True)
        if self.speculation is not None:
            self.speculation.finish(request, reason)
        if request.grammar is not None:
            request.grammar.close()
        request.finish_reason = reason
        try:
            self.outputs.emit(request)
        finally:
            self.requests.pop(request.rid, None)

    def fail_all(self, message: str) -> None:
        """End every request with `message` (after a step failed) and give back their slots,
        those of a step in flight too (its results are never read)."""
        self._in_flight = None
        self.slots.forget_unread()
        for queue in (self.waiting, self.running):
            while queue:
                request = queue.pop()
                request.error = message
                try:
                    self._finish(request, "error")
                except Exception:
                    logger.exception("could not release request %s after a failed step", request.rid)

    # -- checks and stats ---------------------------------------------------------------
    def held_tokens(self) -> int:
        """Slots held by admitted requests themselves (not the cache), in whole pages."""
        return self.slots.held_tokens([*self.waiting, *self.running])

    def check_slot_accounting(self) -> None:
        self.slots.check_accounting([*self.waiting, *self.running])
        self.runner.req_to_token_pool.check_host_copy()

    def stats(self) -> SchedulerStats:
        """The counters (`SchedulerStats` says what each counts)."""
        allocator = self.runner.allocator
        capacity = max(allocator.capacity_tokens, 1)
        cached = self.cache.cached_tokens
        counts = self.speculation.counts if self.speculation is not None else None
        return SchedulerStats(
            kv_cache_usage=(allocator.capacity_tokens - allocator.available_tokens - cached) / capacity,
            kv_cache_cached_usage=cached / capacity,
            num_running_requests=len(self.running),
            num_queued_requests=len(self.waiting),
            prefix_cache_hit_rate=self.cache.hit_rate,
            prefix_cache_tokens=cached,
            num_retractions=self.num_retractions,
            generated_tokens=self.generated_tokens,
            host_tier=self.cache.host_tier_stats(),
            spec_draft_tokens=counts.draft_tokens if counts else 0,
            spec_accepted_tokens=counts.accepted_tokens if counts else 0,
            spec_drafted_rows=counts.drafted_rows if counts else 0,
        )


def _first_positions(drafts: list[list[int]]) -> list[int]:
    """Where each row's positions start among a verify step's logits (a row has k + 1)."""
    starts, total = [], 0
    for draft in drafts:
        starts.append(total)
        total += len(draft) + 1
    return starts


def _per_position(requests: list[Request], drafts: list[list[int]]) -> list[Request]:
    """Each verify position's request (a row's request once per position)."""
    return [request for request, draft in zip(requests, drafts) for _ in range(len(draft) + 1)]
