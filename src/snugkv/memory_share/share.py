"""Several engines on one device (`snugkv serve --kv-elastic`): start without OOM, share KV memory.

The protocol, through the per-device record (`memory_share.record`, a locked JSON file; no server):
1. Ask. Before it loads anything, a starting engine estimates what it needs (weights from the model
   config, an allowance for the CUDA context, graphs and activations, and `--kv-min-tokens` of KV;
   on the host backend only the KV cache lives in the shared budget) and publishes it as a
   `starting` entry's `need_bytes`. Running engines see the ask on their next turn and shrink by
   the deficit (`policy.decide`, urgent). The starter waits until free memory covers its ask
   plus the others' headroom, or fails with a message naming who holds what.
2. Start. Engines that start together (loading at once) agree at their sizing points on what each
   commits (`memory_share.start`: the free memory split by weight, their weights and graphs loaded,
   every headroom kept), so none takes all and none retries. One that starts alone sizes from all
   free memory, holding the other engines' activation headroom with an allocation of its own,
   released as soon as its KV cache is sized; one that registers while others are sizing waits
   until they run, then asks. Then its entry turns `running` with the real figures.
3. Share. Every `interval_s` each engine reads its own state between scheduler steps (`GET /kv`'s
   query), publishes its entry (KV bytes, demand, minimum, maximum, headroom, heartbeat), reads
   everyone's, computes its own target with the pure policy and resizes itself through its engine
   client's resize call, which the scheduler thread runs between steps (`scheduler.elastic`:
   evict cache entries, retract only if needed; no request fails). Hysteresis and a minimum
   interval keep two engines from trading memory back and forth.
4. Leave. An engine that sleeps publishes `sleeping` with no KV; one that stops removes its entry
   after its memory is released; one that crashed is cleared by the next reader (dead pid). The
   others then grow into the freed memory, never beyond what is free now.
5. Wake. A sleeping engine asked to wake asks first, as a starting engine does (the same wait,
   `memory_share.wake` says what it asks for); its rebalancing turns pause meanwhile, so
   the ask stays published until the wake is done.

A process outside snugkv that takes memory shows as free memory below the reserve: every elastic
engine gives back the deficit at once. This module acts only on its own engine, and only through
its `EngineClient` once it serves; the HTTP route that shows the record is the server's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from snugkv.core.engine_client import EngineClient
from snugkv.core.reports import KvResizeReply
from snugkv.engine import Engine, EngineArgs
from snugkv.memory.vmm import GIB
from snugkv.memory_share.estimate import start_estimate
from snugkv.memory_share.policy import (
    SharePolicy,
    decide,
    effective_free_bytes,
    plan_targets,
    pool_bytes,
    reserve_bytes,
)
from snugkv.memory_share.record import (
    LATE,
    RUNNING,
    SIZED,
    SLEEPING,
    STARTING,
    EngineEntry,
    ShareRecord,
    StartPlan,
    device_key,
)
from snugkv.memory_share.start import arrived, registered, sizing_in_progress, wait_for_start_plan
from snugkv.models.loader import resolve_device
from snugkv.sizing.measure import GUEST_ROOM_BYTES, cached_unused_bytes, shared_device_free_bytes
from snugkv.sizing.resize import KvResizeError

logger = logging.getLogger(__name__)

# Free memory the running engines leave on a GPU, so that a new engine can create its CUDA
# context (~0.5 GiB on the H200) and read the device before it asks: on the H200 a second engine
# beside a tiny model (whose headroom is small) ran out of memory creating its context. The share
# keeps it once for all its engines (each engine's own guest room is 0 under --kv-elastic).
START_ROOM_BYTES = GUEST_ROOM_BYTES


class MemoryShareError(RuntimeError):
    """An elastic engine could not get the memory it needs to start; the message says who holds it."""


@dataclass(frozen=True, slots=True)
class ShareOptions:
    weight: float = 1.0  # --memory-share
    min_tokens: int = 4096  # --kv-min-tokens: the KV cache an engine asks for at start and keeps
    interval_s: float = 0.5
    start_timeout_s: float = 120.0
    start_together_s: float = 30.0  # at its sizing point, the longest an engine waits for its cohort
    wake_timeout_s: float = 60.0
    policy: SharePolicy = field(default_factory=SharePolicy)


def share_table(entries: list[EngineEntry], free_bytes: int | None, policy: SharePolicy) -> dict[str, Any]:
    """Every registered engine with its KV now, its weighted share and its target (for people)."""
    running = [e for e in entries if e.state == RUNNING]
    total_weight = sum(e.weight for e in running) or 1.0
    targets = plan_targets(entries, free_bytes, policy) if free_bytes is not None else {}
    return {
        "free_bytes": free_bytes,
        "pool_bytes": pool_bytes(entries, free_bytes) if free_bytes is not None else None,
        "reserve_bytes": reserve_bytes(entries),
        "engines": [
            {
                **e.to_dict(),
                "share": e.weight / total_weight if e.state == RUNNING else 0.0,
                "target_bytes": targets.get(e.pid),
                "heartbeat_age_s": round(time.time() - e.heartbeat, 3),
            }
            for e in sorted(entries, key=lambda e: e.pid)
        ],
    }


class MemoryShare:
    """This engine's side of the protocol: ask before start, then a loop on a thread of its own."""

    def __init__(self, record: ShareRecord, entry: EngineEntry, device: torch.device, options: ShareOptions):
        self.record, self.entry, self.device, self.options = record, entry, device, options
        self.client: EngineClient | None = None  # set by `attach`
        self.resizes: list[dict[str, Any]] = []
        self.waited_s = 0.0
        self.start_split: dict[str, Any] | None = None  # the start plan it committed by, if any
        self._held: torch.Tensor | None = None  # the running engines' headroom, held while it sizes
        self._last_resize = 0.0
        self._last_free: int | None = None  # device free bytes at the last turn
        self.awake_kv_bytes = 0  # its KV cache at the last turn it was awake (a wake asks for it back)
        self._asking = threading.Event()  # a wake's ask holds the entry: turns wait
        self._turn_lock = threading.Lock()  # held by a turn in flight
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- 1. ask, 2. start ----------------------------------------------------------------------
    @classmethod
    def before_start(cls, args: EngineArgs, name: str, options: ShareOptions) -> MemoryShare:
        """Register as starting and wait until the running engines have left room for this one."""
        device = resolve_device(args.parallel.device)
        need, per_token = start_estimate(args, options.min_tokens)
        entry = EngineEntry.of_this_process(
            name,
            options.weight,
            need_bytes=need,
            bytes_per_token=per_token,
            min_kv_bytes=options.min_tokens * per_token,
        )
        share = cls(ShareRecord.for_device(device_key(device)), entry, device, options)
        share._wait_for_memory()
        return share

    def _wait_for_memory(self, what: str = "start") -> None:
        """Publish this engine's ask (`self.entry`, state starting) and wait until free memory covers
        it; `what` (start, wake) names the wait, its time limit, and what a failed one leaves. An ask
        made while other engines are sizing their start (a late starter, a wake) waits until they
        run: their sizing counts on the free memory it would take."""
        timeout_s = self.options.wake_timeout_s if what == "wake" else self.options.start_timeout_s
        started = time.monotonic()
        while True:
            busy = False

            def make(entries: list[EngineEntry], plan: StartPlan | None) -> EngineEntry:
                nonlocal busy
                if what == "start":
                    entry = registered(self.entry, entries, plan)
                    busy = entry.start_phase == LATE
                    return entry
                busy = sizing_in_progress(self.entry.pid, entries, plan)
                return self.entry.beat()

            self.entry, entries = self.record.publish_with(make)
            others = [e for e in entries if e.pid != self.entry.pid and e.state == RUNNING]
            device_free = shared_device_free_bytes(self.device)
            free = None if device_free is None else effective_free_bytes(entries, device_free)
            self.waited_s = time.monotonic() - started
            if not busy and (free is None or not others):  # nobody to ask: what is free is what it gets
                self.entry = self.entry.beat(granted=True)
                self.record.publish(self.entry)
                return
            spare = None if free is None else free - reserve_bytes(entries)
            if not busy and spare is not None and spare >= -self.options.policy.hysteresis_min_bytes:
                self.entry = self.entry.beat(granted=True)
                self.record.publish(self.entry)
                logger.info(
                    "Memory share: %.2f GiB asked and free after %.2f s to %s (%d other engine(s) on %s)",
                    self.entry.need_bytes / GIB,
                    self.waited_s,
                    what,
                    len(others),
                    self.record.path.name,
                )
                return
            if self.waited_s > timeout_s:
                self._withdraw_ask(what)
                if busy or free is None or spare is None:
                    sizing = [e for e in entries if e.pid != self.entry.pid and e.state == STARTING]
                    names = ", ".join(f"pid {e.pid} ({e.name})" for e in sizing) or "none left"
                    raise MemoryShareError(
                        f"could not ask for {self.entry.need_bytes / GIB:.2f} GiB to {what} in {timeout_s:g} s: "
                        f"other engines were sizing their start all that time ({names}); "
                        "stop one that is stuck, or start this one again"
                    )
                held = ", ".join(f"pid {e.pid} ({e.name}) {e.kv_bytes / GIB:.2f} GiB KV" for e in others)
                raise MemoryShareError(
                    f"could not get {self.entry.need_bytes / GIB:.2f} GiB to {what} in "
                    f"{timeout_s:g} s: {free / GIB:.2f} GiB free, {-spare / GIB:.2f} GiB short; "
                    f"the running engines hold {held} and give back only down to their --kv-min-tokens; "
                    "lower --kv-min-tokens here or there, or stop an engine"
                )
            time.sleep(0.1)

    @contextlib.contextmanager
    def holding_others_headroom(self) -> Iterator[None]:
        """While this engine sizes its KV cache from all free memory, keep the other engines'
        activation headroom allocated (on CUDA; on the host backend headroom is 0). The hold is
        published (engines sizing together count it once) and ends early when a start plan is
        agreed (`agree_start_kv`: the plan keeps that headroom free itself)."""
        others = [e for e in self.record.entries() if e.pid != self.entry.pid and e.state == RUNNING]
        headroom = sum(e.headroom_bytes for e in others)
        if self.device.type != "cuda" or headroom == 0:
            yield
            return
        self._held = torch.empty(headroom, dtype=torch.uint8, device=self.device)
        self.entry = self.entry.beat(held_bytes=headroom)
        self.record.publish(self.entry)
        try:
            yield
        finally:
            self._release_hold()

    def _release_hold(self) -> None:
        """Drop the headroom hold; unpublished first, so that no reader counts it free twice."""
        if self._held is None:
            return
        self.entry = self.entry.beat(held_bytes=0)
        self.record.publish(self.entry)
        self._held = None
        torch.cuda.empty_cache()

    def agree_start_kv(
        self, free_bytes: int, kv_bytes: int, headroom_bytes: int, bytes_per_token: int, max_kv_bytes: int
    ) -> int | None:
        """At this engine's start-up sizing point (graphs captured, `free_bytes` measured, `kv_bytes`
        backed already): the KV bytes in all it may back, agreed with the engines starting together
        with it, or None when it starts alone (it sizes from all free memory, as before). Waits for
        the others to reach their sizing points, `ShareOptions.start_together_s` at most
        (`memory_share.start`)."""
        figures = {
            "kv_bytes": kv_bytes,
            "headroom_bytes": headroom_bytes,
            "bytes_per_token": bytes_per_token,
            "min_kv_bytes": self.options.min_tokens * bytes_per_token,
            "max_kv_bytes": max_kv_bytes,
            "start_room_bytes": START_ROOM_BYTES if self.device.type == "cuda" else 0,
        }
        self.entry, _ = self.record.publish_with(
            lambda entries, _plan: arrived(self.entry, entries, free_bytes=free_bytes, **figures)
        )
        plan, waited_s = wait_for_start_plan(
            self.record, self.entry, wait_limit_s=self.options.start_together_s
        )
        if plan is None:
            self.entry = self.entry.beat(start_phase=SIZED)
            self.record.publish(self.entry)
            return None
        grant = plan.grants[self.entry.pid]
        self.entry = self.entry.beat(
            start_phase=SIZED, kv_bytes=grant, kv_tokens=grant // max(bytes_per_token, 1)
        )
        self.record.publish(self.entry)  # published before it commits, as a grow is
        self._release_hold()
        self.start_split = {**plan.to_dict(), "waited_s": round(waited_s, 3)}
        logger.info(
            "Memory share: %d engines starting together split %.2f GiB free (%.2f GiB kept: headroom, asks, "
            "the start room%s): %.2f GiB of KV for this one, after %.2f s at its sizing point",
            len(plan.grants),
            plan.free_bytes / GIB,
            plan.reserve_bytes / GIB,
            f", {len(plan.pending)} not sized yet" if plan.pending else "",
            grant / GIB,
            waited_s,
        )
        return grant

    def started(self, engine: Engine) -> None:
        """The engine is sized: publish its real KV cache and drop the ask at once (the tokenizer and
        the scheduler still load; the others must not give away more meanwhile)."""
        pool = engine.pool
        self.entry = self.entry.beat(
            state=RUNNING,
            kv_bytes=pool.committed_bytes,
            kv_tokens=pool.committed_tokens,
            bytes_per_token=pool.bytes_per_token,
            max_kv_bytes=pool.bytes_for_tokens(engine.kv.limits().max_tokens),
            headroom_bytes=engine.headroom_bytes,
            need_bytes=0,
            start_phase="",
            sizing_free_bytes=0,
        )
        self.record.publish(self.entry)

    def leave(self) -> None:
        """Remove this engine's entry (after its memory is released)."""
        self.record.remove(self.entry.pid)

    # -- 3. share --------------------------------------------------------------------------------
    @property
    def attached(self) -> EngineClient:
        """The engine this share resizes (`attach` sets it)."""
        if self.client is None:
            raise RuntimeError("the memory share is not attached to an engine yet")
        return self.client

    def attach(self, client: EngineClient, url: str) -> None:
        """Serve: publish the real figures now, then rebalance on a thread until `stop`."""
        self.client = client
        self.entry = self.entry.beat(url=url)
        asyncio.run(self.turn())
        self._thread = threading.Thread(target=self._run, name="snugkv-memory-share", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.run(self._loop())

    async def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                with self._turn_lock:  # this thread's own event loop: nothing else waits on it
                    if not self._asking.is_set():
                        await self.turn()
            except RuntimeError as exc:  # the scheduler loop is gone: nothing to share any more
                logger.warning("Memory share stopped: %s", exc)
                return
            except (OSError, ValueError, KeyError) as exc:  # the record unreadable for a moment: next turn
                logger.warning("Memory share: a turn failed (%s: %s); trying again", type(exc).__name__, exc)
            await asyncio.sleep(self.options.interval_s)

    async def turn(self) -> KvResizeReply | None:
        """One turn: publish, read, decide, maybe resize. Returns the resize it made, if any."""
        client = self.attached
        info = await client.kv_info()
        cache = info.cache
        if not cache.resizable:  # sized without virtual memory (no CUDA VMM): nothing to share
            logger.warning("Memory share: this engine's KV cache cannot be resized; it keeps its size")
            self._stop.set()
            return None
        sleeping = "kv_cache" in cache.sleeping_tags
        page, per_token = cache.page_size, max(int(cache.bytes_per_token), 1)
        floor_tokens = max(
            self.options.min_tokens, info.min_tokens_without_failing_a_request, cache.min_tokens
        )
        floor_tokens = min(-(-floor_tokens // page) * page, cache.max_tokens)
        self.entry = self.entry.beat(
            state=SLEEPING if sleeping else RUNNING,
            kv_bytes=0 if sleeping else cache.committed_bytes,
            kv_tokens=0 if sleeping else cache.max_total_num_tokens,
            bytes_per_token=per_token,
            min_kv_bytes=floor_tokens * per_token,
            max_kv_bytes=cache.max_tokens_bytes,
            demand_bytes=info.demand_tokens * per_token,
            headroom_bytes=cache.headroom_bytes,
            cached_bytes=cached_unused_bytes(self.device),
            start_room_bytes=START_ROOM_BYTES if self.device.type == "cuda" else 0,
            need_bytes=0,
        )
        entries = self.record.publish(self.entry)
        free = effective_free_bytes(entries, cache.device_free_bytes)
        self._last_free = free
        if sleeping:
            return None
        self.awake_kv_bytes = cache.committed_bytes
        since = time.monotonic() - self._last_resize
        others_at = max((e.resized_at for e in entries if e.pid != self.entry.pid), default=0.0)
        decision = decide(
            self.entry,
            entries,
            free,
            seconds_since_resize=since,
            seconds_since_others_resized=time.time() - others_at,
            policy=self.options.policy,
        )
        if decision.target_bytes is None:
            return None
        tokens = decision.target_bytes // per_token // page * page
        if tokens > cache.max_total_num_tokens:  # granule-aligned backing must fit what is free
            tokens = min(tokens, cache.tokens_fitting_free_memory)
        tokens = int(min(max(tokens, floor_tokens), cache.max_tokens))
        if tokens == cache.max_total_num_tokens:
            return None
        self._last_resize = time.monotonic()
        self.entry = self.entry.beat(resizing=True, resized_at=time.time())
        if tokens > cache.max_total_num_tokens:  # a grow is published before it takes the memory
            self.entry = self.entry.beat(kv_bytes=tokens * per_token, kv_tokens=tokens)
        self.record.publish(self.entry)
        try:
            reply = await client.resize_kv(max_total_num_tokens=tokens)
        except KvResizeError as exc:  # memory not back yet, a request grew meanwhile: next turn
            logger.info("Memory share: resize to %d tokens refused (%s); trying again later", tokens, exc)
            self.entry = self.entry.beat(
                kv_bytes=cache.committed_bytes, kv_tokens=cache.max_total_num_tokens, resizing=False
            )
            self.record.publish(self.entry)
            return None
        change = reply.change
        logger.info(
            "Memory share: KV %d -> %d tokens (%.2f GiB) to rebalance: %s",
            cache.max_total_num_tokens,
            tokens,
            change.to_committed_bytes / GIB,
            decision.reason,
        )
        record = {
            "at": time.time(),
            "to_tokens": tokens,
            "reason": decision.reason,
            "took_ms": change.took_ms,
        }
        self.resizes = [*self.resizes[-31:], record]
        self.entry = self.entry.beat(
            kv_bytes=change.to_committed_bytes, kv_tokens=tokens, resized_at=time.time(), resizing=False
        )
        self.record.publish(self.entry)
        return reply

    # -- 5. wake -------------------------------------------------------------------------------
    def ask_to_wake(self, need_bytes: int) -> None:
        """Publish a wake's ask of `need_bytes` (after the turn in flight, if any; turns then wait)
        and block until the others have given it, or raise `MemoryShareError` naming who holds
        what. Run it off the event loop; `woken` ends the hold."""
        with self._turn_lock:
            self._asking.set()
        self.entry = self.entry.beat(
            state=STARTING,
            kv_bytes=0,
            kv_tokens=0,
            need_bytes=need_bytes,
            granted=False,
            resizing=False,
            start_phase="",  # a wake joins no start cohort
        )
        try:
            self._wait_for_memory("wake")
        except BaseException:
            self.woken()
            raise

    def woken(self) -> None:
        """The wake is done (or failed): the entry goes back to the turns, whose next one publishes
        the engine's real state (running with its new KV cache, or still sleeping)."""
        if self.entry.state == STARTING and not self.entry.granted:  # no grant: the ask goes at once
            self._withdraw_ask("wake")
        self._asking.clear()

    def _withdraw_ask(self, what: str) -> None:
        """An ask not met: a starter leaves the record, a waking engine goes back to sleeping."""
        if what == "start":
            self.record.remove(self.entry.pid)
            return
        self.entry = self.entry.beat(state=SLEEPING, need_bytes=0)
        self.record.publish(self.entry)

    def stop(self) -> None:
        """Stop rebalancing (before the engine stops)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- 6. show ---------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        free = self._last_free  # as the scheduler thread read it (no device call from a route)
        return {
            "device": self.record.path.name,
            "this_pid": self.entry.pid,
            "waited_for_memory_s": round(self.waited_s, 3),
            "start_split": self.start_split,
            "resizes": self.resizes,
            **share_table(self.record.entries(), free, self.options.policy),
        }
