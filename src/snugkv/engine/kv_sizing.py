"""The KV cache's size, in one object: the pool, its caps and the activation headroom, sized from
the free memory measured now at start-up, on a resize and on wake alike.

The steps every sizing takes, each a method:
    measure   free device memory now, the MIN over ranks (`sizing.measure`, the one reader)
    size      the most tokens whose backing fits `free - headroom` and leaves the guest room to the
              driver (less what a caller keeps free),
              under the caps: the address space reserved at start-up, `--max-total-tokens` and what
              `--max-device-memory` leaves the KV cache; agreed as the MIN over ranks
    commit    back that many tokens (5% fewer per failed attempt, every rank alike) and let the
              allocator hand them out; a run-time resize commits by growing (all ranks or none)
              or by shrinking, the live pages moved below the bound first (`runner.kv_resize`)
    recap     `max_running_requests` follows the size (never more requests than pages)

`size_from_free()` is measure then size. Start-up's post-capture step (`size_after_capture`: the
pipeline's steps 5 to 7 after the graphs are captured), a resize that leaves `free_gib` free
(`tokens_leaving_free`), a wake (`back_after_sleep`) and memory pressure (`pressure_move`) all
take it.

The guest room: every sizing also leaves at least `guest_room_bytes` free to the driver, so that
another process can start on the device (create its CUDA context and ask for memory, which the
engine then yields). The headroom's workspace part is held in torch's cache, where no other process
can take it; the rest of the headroom (the margin) is free at the driver and counts toward the room,
so sizing keeps `guest_extra_bytes` more than the headroom.

Memory pressure: start-up measured what was free then; another process may take device memory
later, and the activation headroom the engine keeps free beside its KV cache would go with it (the
next large step runs out of memory). `pressure_move` measures again (between steps, when the
driver's memory check asks: `driver.pressure`) and answers a shrink to what fits now, less a slack,
when free memory fell below the headroom (the guest room is there to be taken: using its part
beyond the headroom moves nothing), or a grow to what start-up sizing would give now (guest room
kept) when at least `pressure_hysteresis_tokens` more fit (so a shrink is not followed by a grow by
the same few pages, back and forth).

A resize goes to a `KvTarget` (`target`: a count checked against the limits once, before the
scheduler makes room for it), and the pool's committed size is read through `committed_tokens`.

This object never loads, captures or schedules: which requests give way to a shrink is the
scheduler's (`scheduler.elastic`), whether memory pressure moves the cache now is the driver's
(`driver.pressure`: `pressure_move` only measures and says how far), the graphs and weights are
the engine's. It keeps the history of changes (`events`); the engine's report records each with a
fresh ledger.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from snugkv.core.reports import KvCacheView, KvResize
from snugkv.memory.kv_pool import KVPool
from snugkv.memory.moves import KvMoves
from snugkv.memory.vmm import GIB, MIB, CommitError, VirtualMemory
from snugkv.memory.vmm_plain import PlainMemory
from snugkv.runner import kv_resize
from snugkv.runner.model_runner import ModelRunner
from snugkv.sizing.measure import FreeMemory, agree_min, measure_free
from snugkv.sizing.modes import SizingMode
from snugkv.sizing.post_capture import (
    SizingError,
    finalize_with_retry,
    no_kv_memory_message,
    recap_running_requests,
    tokens_for_budget,
)
from snugkv.sizing.resize import KvResizeError, ResizeLimits, cap_tokens, check_free_gib

logger = logging.getLogger(__name__)

EVENT_HISTORY = 32  # resizes, sleeps and wakes kept for GET /kv (newest last)
PRESSURE_HYSTERESIS = 0.005  # a pressure grow needs this share of the reserve more to fit (at least 4 pages)
PRESSURE_HYSTERESIS_MAX_BYTES = 512 * MIB  # and at most this much KV: back within 0.5% of the start size


@dataclass(frozen=True, slots=True)
class KvFit:
    """What `size_from_free` found: the tokens that fit, and the free memory they were sized from."""

    tokens: int
    free: FreeMemory


@dataclass(frozen=True, slots=True)
class PressureMove:
    """What memory pressure asks of the KV cache now: `tokens` for `reason` ("pressure": free memory
    fell below the headroom; "pressure-grow": memory came back), measured from `free`."""

    tokens: int
    reason: str
    free: FreeMemory

    @property
    def shrinks(self) -> bool:
        return self.reason == "pressure"


@dataclass(frozen=True, slots=True)
class KvTarget:
    """A size the KV cache may be resized to now: `tokens`, whole pages within the limits
    (`KvSizing.target` checked them once). The caller checked that the engine can resize before it
    made one (`Engine.check_resizable`, `Engine.watches_pressure`) and takes it to
    `Engine.resize_kv` within the same turn, so the resize checks nothing again."""

    tokens: int


@dataclass(frozen=True, slots=True)
class StartupSizing:
    """What the post-capture step sized: the figures the start-up report shows."""

    max_total_num_tokens: int
    max_running_requests: int
    retries: int
    per_rank_free_bytes: tuple[int, ...]
    sizing_ms: float
    timings: dict[str, float] = field(default_factory=dict)  # keys carry their unit


@dataclass(frozen=True, slots=True)
class KvCaps:
    """The user's bounds on the KV cache and the engine's request limit (resolved flags)."""

    page_size: int
    max_total_tokens: int | None  # --max-total-tokens
    max_device_memory_gib: float | None  # --max-device-memory: the whole engine's cap
    max_running_requests: int  # --max-running-requests, before a small pool lowers it


StartGate = Callable[[int, int, int, int, int], "int | None"]
"""What engines that start together on one device agree at each one's start-up sizing point
(`MemoryShare.agree_start_kv`): given (free bytes measured, KV bytes backed already, headroom, bytes
per token, the most KV bytes), the KV bytes this engine may back in all, or None (it starts alone:
all free memory less its headroom)."""


class KvSizing:
    """The pool of `runner`, its caps and the activation headroom kept free beside it.

    `held_besides_kv()` is what the engine holds on the device besides the KV cache (weights,
    graphs, buffers): what `--max-device-memory` counts before the KV cache gets its part.
    `workspace_bytes` (the activation peak) is how much of torch's unused cache every reading counts
    as free: the engine keeps its activation workspace there and never empties it while it serves
    (`sizing.measure`), so a step asks the driver for nothing."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        mode: SizingMode,
        memory: VirtualMemory,
        group: dist.ProcessGroup | None,
        caps: KvCaps,
        headroom_bytes: int,
        workspace_bytes: int,
        held_besides_kv: Callable[[], int],
        guest_room_bytes: int = 0,
        device_type: str,
        start_gate: StartGate | None = None,
    ) -> None:
        self.runner = runner
        self.pool: KVPool = runner.kv_pool
        self.mode = mode
        self.memory = memory
        self.group = group
        self.caps = caps
        self.headroom_bytes = headroom_bytes
        self.workspace_bytes = workspace_bytes
        self.guest_room_bytes = guest_room_bytes
        # what the driver keeps of the headroom (its margin) counts toward the room
        self.guest_extra_bytes = max(0, guest_room_bytes - max(0, headroom_bytes - workspace_bytes))
        self._held_besides_kv = held_besides_kv
        self._device_type = device_type
        self._start_gate = start_gate
        self.events: deque[KvResize] = deque(maxlen=EVENT_HISTORY)
        self.event_count = 0  # every change so far (`events` keeps the last EVENT_HISTORY)
        self.pressure_shrinks = 0  # changes recorded as "pressure" / "pressure-grow"
        self.pressure_grows = 0
        # The size the last explicit resize (POST /kv/resize, `LLM.resize_kv`) set: a pressure grow
        # goes no further, so it never takes back the room an operator made (for another process
        # that is still starting, say). None: up to what start-up sizing gives now.
        self.resize_ceiling_tokens: int | None = None
        self._hysteresis_tokens: int | None = None

    @property
    def page_size(self) -> int:
        return self.caps.page_size

    @property
    def committed_tokens(self) -> int:
        """The tokens the pool backs now (what the allocator hands out): the one reading of the
        cache's size for the layers above."""
        return self.pool.committed_tokens

    @property
    def resizable(self) -> bool:
        """Sized with virtual memory whose backing can come and go (post-capture)."""
        return self.mode is SizingMode.POST_CAPTURE and not isinstance(self.memory, PlainMemory)

    # -- the caps ---------------------------------------------------------------------------
    def cap_bytes(self) -> int | None:
        """What `--max-device-memory` leaves the KV cache: the cap less everything else the engine
        holds now and the activation headroom (None without a cap)."""
        if self.caps.max_device_memory_gib is None:
            return None
        return int(self.caps.max_device_memory_gib * GIB) - self._held_besides_kv() - self.headroom_bytes

    def largest_tokens(self) -> int:
        """The most tokens the cache could ever hold: the reserve under `--max-total-tokens` (the
        same on every rank; `--max-device-memory`'s share is left out, as it is measured per rank
        and moves with what the engine holds, and a scheduler's decisions must not differ)."""
        bounds = [self.pool.reserved_tokens, self.caps.max_total_tokens]
        return min(bound for bound in bounds if bound is not None) // self.page_size * self.page_size

    def limits(self) -> ResizeLimits:
        """The token counts a resize may ask for now."""
        page = self.page_size
        return ResizeLimits(
            page_size=page,
            min_tokens=2 * page,
            reserved_tokens=self.pool.reserved_tokens,
            max_total_tokens=self.caps.max_total_tokens,
            cap_tokens=cap_tokens(self.pool, self.cap_bytes()),
            max_device_memory_gib=self.caps.max_device_memory_gib,
        )

    def target(self, tokens: object, param: str = "max_total_num_tokens") -> KvTarget:
        """`tokens` rounded down to whole pages as a size a resize may go to now, or `KvResizeError`
        naming the limit it breaks (`param`: the request field that asked)."""
        return KvTarget(self.limits().check(tokens, param))

    # -- the steps --------------------------------------------------------------------------
    def measure(self) -> FreeMemory:
        return measure_free(self.memory, self.group, workspace_bytes=self.workspace_bytes)

    def size(
        self,
        free: FreeMemory,
        *,
        keep_free_bytes: int = 0,
        kv_cap_bytes: int | None = None,
        guest_room: bool = True,
    ) -> int:
        """The most tokens that fit `free` less the headroom, the guest room's part beyond it (unless
        `guest_room` is False: what a pressure shrink asks) and `keep_free_bytes`, under the caps (and `kv_cap_bytes`
        of KV in all, when given), agreed as the MIN over ranks (what the pool backs already counts
        as usable)."""
        cap = self.cap_bytes()
        if kv_cap_bytes is not None:
            cap = kv_cap_bytes if cap is None else min(cap, kv_cap_bytes)
        tokens = tokens_for_budget(
            self.pool,
            free.min_bytes - keep_free_bytes - (self.guest_extra_bytes if guest_room else 0),
            self.headroom_bytes,
            self.caps.max_total_tokens,
            cap,
        )
        return agree_min(tokens, self.group)

    def size_from_free(self, *, keep_free_bytes: int = 0) -> KvFit:
        """Measure, then size: the tokens the free memory of now holds."""
        free = self.measure()
        return KvFit(self.size(free, keep_free_bytes=keep_free_bytes), free)

    def commit(self, tokens: int) -> tuple[int, int]:
        """Back `tokens` (fewer if memory went meanwhile, every rank alike) and let the allocator
        hand them out; returns (tokens backed, retries). Raises `SizingError` when nothing fits."""
        tokens, retries = finalize_with_retry(self.pool, tokens, self.group)
        self.runner.allocator.resize(tokens)
        return tokens, retries

    def recap(self, tokens: int) -> int:
        """`max_running_requests` for a pool of `tokens` (back up to the flag's value when it grew)."""
        max_running = recap_running_requests(self.caps.max_running_requests, tokens, self.page_size)
        self.runner.req_to_token_pool.cap_requests(max_running)
        return max_running

    # -- start-up ---------------------------------------------------------------------------
    def size_after_capture(self) -> StartupSizing:
        """The post-capture step: with the graphs captured and the activation peak measured,
        measure free memory, size the KV cache to it, commit (with retry), resize the allocators
        and re-cap the request limit. With a start gate, the KV bytes are those agreed with the
        engines starting together (it waits for them to reach this point)."""
        measured = time.perf_counter()
        free = self.measure()
        measure_ms = (time.perf_counter() - measured) * 1e3
        self.check_cap_leaves_room()
        grant: int | None = None
        agreeing = time.perf_counter()
        if self._start_gate is not None:
            grant = self._start_gate(
                free.min_bytes,
                self.pool.committed_bytes,
                self.headroom_bytes,
                int(self.pool.bytes_per_token),
                self.pool.bytes_for_tokens(self.largest_tokens()),
            )
        committing = time.perf_counter()
        tokens = self.size(free, kv_cap_bytes=grant)
        if tokens <= 0:
            raise SizingError(no_kv_memory_message(free, self.headroom_bytes, self.guest_extra_bytes))
        tokens, retries = finalize_with_retry(self.pool, tokens, self.group)
        resized = time.perf_counter()
        self.runner.allocator.resize(tokens)
        resize_ms = (time.perf_counter() - resized) * 1e3
        self.check_usable()
        max_running = self.recap(tokens)
        return StartupSizing(
            tokens,
            max_running,
            retries,
            free.per_rank_bytes,
            sizing_ms=(time.perf_counter() - measured) * 1e3,
            timings={
                "sizing_measure_ms": measure_ms,
                "sizing_agree_ms": (committing - agreeing) * 1e3,
                "sizing_commit_ms": (resized - committing) * 1e3,
                "sizing_resize_ms": resize_ms,
            },
        )

    def check_cap_leaves_room(self) -> None:
        """`SizingError` when `--max-device-memory` leaves less than two KV pages, saying how much
        the engine holds besides and what cap it needs."""
        kv_cap = self.cap_bytes()
        if kv_cap is None or self.pool.max_tokens_within(kv_cap) >= 2 * self.page_size:
            return
        others = self._held_besides_kv()
        need = others + self.headroom_bytes + self.pool.bytes_for_tokens(2 * self.page_size)
        raise SizingError(
            f"--max-device-memory {self.caps.max_device_memory_gib:g} GiB leaves no room for the KV cache: "
            f"the engine already holds {others / GIB:.2f} GiB (weights, graphs, buffers) and keeps "
            f"{self.headroom_bytes / GIB:.2f} GiB of activation headroom; raise it to at least {need / GIB:.2f} GiB"
        )

    def check_usable(self) -> None:
        """A pool whose allocator can hand out nothing (e.g. a sliding-window sub-pool rounded down
        to 0 pages) would refuse every request: say so at start-up instead."""
        usable = self.runner.allocator.capacity_tokens
        page = self.page_size
        if usable < 2 * page:  # one page for a prompt, one for its first new token
            raise SizingError(
                f"the KV cache holds {usable} usable tokens, less than two pages of {page}; "
                "raise --max-total-tokens (or --host-kv-gib on CPU), lower --page-size, or for a "
                "sliding-window model raise --swa-full-tokens-ratio"
            )

    # -- run time ---------------------------------------------------------------------------
    def tokens_leaving_free(self, free_gib: float) -> int:
        """The KV size that leaves `free_gib` of device memory free beyond the activation headroom,
        measured now as the MIN over ranks (and kept under the caps)."""
        free_gib = check_free_gib(free_gib)
        fit = self.size_from_free(keep_free_bytes=int(free_gib * GIB))
        if fit.tokens < 2 * self.page_size:
            raise KvResizeError(
                f"free_gib={free_gib:g} leaves room for only {fit.tokens} KV tokens ({fit.free.min_bytes / GIB:.2f} GiB "
                f"free, {self.headroom_bytes / GIB:.2f} GiB activation headroom); ask for less free memory",
                param="free_gib",
            )
        return fit.tokens

    def pressure_hysteresis_tokens(self) -> int:
        """How many more tokens must fit before memory pressure grows the cache (whole pages): a
        share of the reserve (at most 1 GiB of KV), the same at every size, so a shrink's slack
        (half of it) never reaches it."""
        if self._hysteresis_tokens is None:  # the reserve never changes: found once (a search)
            page = self.page_size
            share = min(
                int(self.pool.reserved_tokens * PRESSURE_HYSTERESIS),
                self.pool.max_tokens_within(PRESSURE_HYSTERESIS_MAX_BYTES),
            )
            self._hysteresis_tokens = max(4 * page, share // page * page)
        return self._hysteresis_tokens

    def pressure_move(self) -> PressureMove | None:
        """Measure free memory now (MIN over ranks) and say whether the cache must shrink (free
        memory below the activation headroom: to what fits, less half the hysteresis so that the
        next grow is not a step away) or may grow back (to what start-up sizing gives now, at most
        the size the last explicit resize set, when at least the hysteresis more fits); None: it
        stays. Every rank answers alike."""
        free = self.measure()  # every 0.25 s: no sync, no emptied cache
        committed = self.committed_tokens
        limits = self.limits()
        hysteresis = self.pressure_hysteresis_tokens()
        page = self.page_size
        fitting = self.size(free, guest_room=False)  # the headroom touched: the guest room is gone
        if fitting < committed:
            slack = hysteresis // 2 // page * page
            tokens = max(limits.min_tokens, min(fitting - slack, limits.max_tokens))
            return PressureMove(tokens, "pressure", free) if tokens < committed else None
        tokens = min(self.size(free), limits.max_tokens)
        if self.resize_ceiling_tokens is not None:
            tokens = min(tokens, self.resize_ceiling_tokens)
        if tokens - committed >= hysteresis:
            return PressureMove(tokens, "pressure-grow", free)
        return None

    def resize(
        self,
        target: KvTarget,
        *,
        on_move: Callable[[KvMoves], None] | None = None,
        evicted_tokens: int = 0,
        retracted_requests: int = 0,
        dropped_tokens: int = 0,
        room_ms: float = 0.0,
        reason: str = "resize",
        free_bytes: int | None = None,
    ) -> KvResize:
        """Grow or shrink to `target`. A grow commits more of every buffer, on every rank or none;
        a shrink moves the pages in use above the bound below it (`on_move` lets the prefix cache
        follow) and decommits the rest, and is refused when they do not fit. The allocators and the
        request limit follow; graphs stay valid."""
        tokens = target.tokens
        old_tokens, old_bytes = self.committed_tokens, self.pool.committed_bytes
        waiting = time.perf_counter()
        if tokens < old_tokens:  # the step in flight ends first: its time is not the move's
            self.pool.arena.synchronize()
        started = time.perf_counter()
        moved = kv_resize.MoveStats()
        if tokens > old_tokens:  # from the driver's free memory: the sizing kept the workspace apart
            self._grow(old_tokens, tokens)
        elif tokens < old_tokens:
            try:
                moved = kv_resize.shrink(self.runner, tokens, on_move)
            except kv_resize.ShrinkDoesNotFit as exc:
                raise KvResizeError(str(exc), status=409) from exc
        return KvResize(
            reason,
            old_tokens,
            tokens,
            old_bytes,
            self.pool.committed_bytes,
            self.recap(tokens),
            (time.perf_counter() - started) * 1e3,
            moved.moved_pages,
            moved.moved_window_pages,
            moved.copied_bytes,
            evicted_tokens,
            retracted_requests,
            free_bytes,
            dropped_tokens=dropped_tokens,
            room_ms=room_ms,
            waited_ms=(started - waiting) * 1e3,
        )

    def _grow(self, old_tokens: int, tokens: int) -> None:
        """Commit on every rank or on none: a rank that could not back it makes all give it back."""
        error: CommitError | None = None
        try:
            kv_resize.grow(self.runner, tokens)
        except CommitError as exc:
            error = exc
        if agree_min(int(error is None), self.group):
            return
        if error is None:
            kv_resize.shrink(self.runner, old_tokens)  # nothing was handed out above old_tokens yet
        reason = error or "another tensor-parallel rank ran out of memory"
        raise KvResizeError(
            f"could not back {tokens} KV tokens ({reason}); free device memory or ask for fewer", status=409
        )

    def release(self) -> None:
        """Decommit the whole KV cache, the dummy page included (the engine sleeps); every slot
        must be free."""
        kv_resize.release(self.runner)

    def back_after_sleep(self) -> int:
        """Wake: back the dummy page, then size from the free memory of now (not the old count)
        and commit at the old addresses, so kept graphs run as they are; returns the tokens. A
        refusal (no memory) leaves the cache released and is a `KvResizeError` (409)."""
        pool = self.pool
        try:
            pool.ensure_prefix()
        except CommitError as exc:  # not even the dummy page fits: a 409, not a server error
            pool.release_backing()
            raise KvResizeError(
                f"no memory to wake the KV cache into ({exc}); free device memory and wake again", status=409
            ) from exc
        fit = self.size_from_free()
        if fit.tokens < 2 * self.page_size:
            pool.release_backing()
            raise KvResizeError(
                f"no memory to wake the KV cache into: {fit.free.min_bytes / GIB:.2f} GiB free, "
                f"{self.headroom_bytes / GIB:.2f} GiB kept as activation headroom; free device memory and wake again",
                status=409,
            )
        try:
            tokens, _ = self.commit(fit.tokens)
        except SizingError as exc:  # memory taken meanwhile, on some rank: every rank stays asleep
            pool.release_backing()
            raise KvResizeError(str(exc), status=409) from exc
        return tokens

    def record(self, change: KvResize) -> None:
        self.events.append(change)
        self.event_count += 1
        self.pressure_shrinks += change.reason == "pressure"
        self.pressure_grows += change.reason == "pressure-grow"
        if change.reason == "resize":
            self.resize_ceiling_tokens = change.to_tokens

    def view(self, *, max_running_requests: int, sleeping_tags: frozenset[str]) -> KvCacheView:
        """The KV cache now and what a resize would need (this rank's view; no collective)."""
        pool, allocator = self.pool, self.runner.allocator
        limits = self.limits()
        free = self.memory.mem_get_info()[0]
        kv_cap = self.cap_bytes()
        return KvCacheView(
            max_total_num_tokens=pool.committed_tokens,
            capacity_tokens=allocator.capacity_tokens,
            available_tokens=allocator.available_tokens,
            page_size=self.page_size,
            committed_bytes=pool.committed_bytes,
            reserved_bytes=pool.reserved_bytes,
            reserved_tokens=pool.reserved_tokens,
            bytes_per_token=pool.bytes_per_token,
            chunk_bytes=pool.arena.chunk_bytes,
            granularity_bytes=pool.arena.vmm.granularity_bytes,
            min_tokens=limits.min_tokens,
            max_tokens=limits.max_tokens,
            max_tokens_bytes=pool.bytes_for_tokens(limits.max_tokens),
            max_total_tokens=self.caps.max_total_tokens,
            max_device_memory_gib=self.caps.max_device_memory_gib,
            cap_tokens=limits.cap_tokens,
            device_free_bytes=free,
            headroom_bytes=self.headroom_bytes,
            tokens_fitting_free_memory=tokens_for_budget(
                pool, free - self.guest_extra_bytes, self.headroom_bytes, self.caps.max_total_tokens, kv_cap
            ),
            max_running_requests=max_running_requests,
            resizable=self.resizable,
            sleeping_tags=sleeping_tags,
            events=tuple(self.events),
            guest_room_bytes=self.guest_room_bytes,
        )
