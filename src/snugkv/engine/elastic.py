"""The engine at run time: resize the KV cache, sleep and wake, with the captured graphs kept valid.

A post-capture engine holds its KV cache (and its weights) in virtual memory whose addresses never
change, so physical memory can come and go under graphs captured once. `resize_kv` grows or shrinks
the cache (the scheduler's elastic module first makes a shrink fit by evicting cache entries and,
only if needed, retracting requests; snugkv.runner.kv_resize moves the live pages). `sleep`
releases the KV cache and/or the weights, `wake_up` takes them back at the same addresses and sizes
the KV cache again from free memory measured then. `--max-device-memory` caps the whole engine on
every change. With tensor parallelism every rank makes the same change (counts agreed as the MIN).

`ElasticMemory` is the run-time half of `Engine` (snugkv.engine.pipeline holds the start-up
half); it owns the history of changes and the sleep state, and never sizes anything at start-up.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from snugkv.core.reports import KvCacheView, KvResize, MemoryLedger, SleepState, StartupReport
from snugkv.distributed.group import TensorParallel, use_tensor_parallel
from snugkv.memory.kv_pool import KVPool
from snugkv.memory.moves import KvMoves
from snugkv.memory.vmm import GIB, CommitError, VirtualMemory
from snugkv.memory.vmm_plain import PlainMemory
from snugkv.models.loader import LoadedModel, fill_weights
from snugkv.runner import kv_resize
from snugkv.runner.model_runner import ModelRunner
from snugkv.sizing.measure import agree_min, measure_free, settle
from snugkv.sizing.modes import SizingMode
from snugkv.sizing.post_capture import SizingError, finalize_with_retry, tokens_for_budget
from snugkv.sizing.resize import KvResizeError, ResizeLimits, cap_tokens, check_free_gib

if TYPE_CHECKING:
    from snugkv.engine.args import EngineArgs

SLEEP_TAGS = frozenset({"weights", "kv_cache", "cuda_graph"})  # what sleep can release (SGLang's names)
# Without tags sleep keeps the graphs (wake needs no capture); naming `cuda_graph` releases their
# memory pool too, and wake captures them again (before the KV cache is sized, as at start-up).
DEFAULT_SLEEP_TAGS = frozenset({"weights", "kv_cache"})
WAKE_ORDER = ("weights", "cuda_graph", "kv_cache")  # each is sized or captured from the ones before
EVENT_HISTORY = 32  # resizes, sleeps and wakes kept for GET /kv (newest last)


class ElasticMemory:
    """Run-time resize, sleep and wake of an engine; `Engine` mixes it in after start-up."""

    # Set by the engine's start-up (snugkv.engine.pipeline.Engine).
    args: EngineArgs
    device: torch.device
    group: dist.ProcessGroup | None
    tp: TensorParallel
    mode: SizingMode
    memory: VirtualMemory
    loaded: LoadedModel
    runner: ModelRunner | None
    pool: KVPool
    headroom_bytes: int
    report: StartupReport
    _graph_driver_bytes: int

    def _init_elastic(self) -> None:
        self.kv_events: deque[KvResize] = deque(maxlen=EVENT_HISTORY)
        self.kv_event_count = 0  # every change so far (the history keeps the last EVENT_HISTORY)
        self.sleeping_tags: frozenset[str] = frozenset()  # what sleep released: "weights", "kv_cache"
        self.sleep_level = 0  # of the last sleep: 1 keeps the weights on the host, 2 drops them
        self._history_vocab: int | None = None  # the token history's, while the KV cache sleeps

    if TYPE_CHECKING:  # the start-up half provides these

        @property
        def _page_size(self) -> int: ...
        def _kv_cap_bytes(self, pool: KVPool, headroom_bytes: int) -> int | None: ...
        def _recap(self, runner: ModelRunner, tokens: int) -> int: ...
        def _measure_ledger(self) -> MemoryLedger: ...
        def _capture(self, runner: ModelRunner) -> tuple[int, float]: ...
        def _log(self, message: str, *args: Any) -> None: ...

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def kv_limits(self) -> ResizeLimits:
        """The token counts a resize may ask for now."""
        page = self._page_size
        kv_cap = self._kv_cap_bytes(self.pool, self.headroom_bytes)
        return ResizeLimits(
            page_size=page,
            min_tokens=2 * page,
            reserved_tokens=self.pool.reserved_tokens,
            max_total_tokens=self.args.max_total_tokens,
            cap_tokens=cap_tokens(self.pool, kv_cap),
            max_device_memory_gib=self.args.max_device_memory_gib,
        )

    def check_resizable(self) -> ModelRunner:
        """The runner, or `KvResizeError` saying why the KV cache cannot change size now."""
        if self.runner is None:
            raise KvResizeError("the engine is closed", status=409)
        if self.mode is not SizingMode.POST_CAPTURE or isinstance(self.memory, PlainMemory):
            raise KvResizeError(
                f"this engine sized its KV cache with --kv-sizing {self.mode}, whose memory cannot be given "
                "back; start it with --kv-sizing post-capture to resize at run time",
                status=409,
            )
        if self.is_sleeping:
            raise KvResizeError(
                "the engine is asleep (its KV cache is released); wake it first (POST /wake_up)", status=409
            )
        return self.runner

    def kv_tokens_for_free_gib(self, free_gib: float) -> int:
        """The KV size that leaves `free_gib` of device memory free beyond the activation headroom,
        measured now as the MIN over ranks (and kept under the caps)."""
        self.check_resizable()
        free_gib = check_free_gib(free_gib)
        free = measure_free(self.memory, self.group)
        tokens = tokens_for_budget(
            self.pool,
            free.min_bytes - int(free_gib * GIB),
            self.headroom_bytes,
            self.args.max_total_tokens,
            self._kv_cap_bytes(self.pool, self.headroom_bytes),
        )
        tokens = agree_min(tokens, self.group)
        if tokens < 2 * self._page_size:
            raise KvResizeError(
                f"free_gib={free_gib:g} leaves room for only {tokens} KV tokens ({free.min_bytes / GIB:.2f} GiB "
                f"free, {self.headroom_bytes / GIB:.2f} GiB activation headroom); ask for less free memory",
                param="free_gib",
            )
        return tokens

    def resize_kv(
        self,
        max_total_num_tokens: int,
        *,
        on_move: Callable[[KvMoves], None] | None = None,
        evicted_tokens: int = 0,
        retracted_requests: int = 0,
    ) -> KvResize:
        """Grow or shrink the KV cache to `max_total_num_tokens` (rounded down to whole pages).

        Growing commits more of every buffer (never beyond the reserved address space). Shrinking
        moves the pages in use above the new bound below it (`on_move` lets the prefix cache follow)
        and decommits the rest; the pages in use must fit (the scheduler's elastic module evicts and
        retracts first; `evicted_tokens`/`retracted_requests` are what it freed, for the record).
        Every allocator and `max_running_requests` follow; graphs stay valid. Raises
        `KvResizeError` naming the limit when the count is out of bounds or the engine cannot.
        """
        runner = self.check_resizable()
        tokens = self.kv_limits().check(max_total_num_tokens)
        started = time.perf_counter()
        old_tokens, old_bytes = self.pool.committed_tokens, self.pool.committed_bytes
        moved = kv_resize.MoveStats()
        if tokens > old_tokens:
            self._grow_kv(runner, old_tokens, tokens)
        elif tokens < old_tokens:
            try:
                moved = kv_resize.shrink(runner, tokens, on_move)
            except kv_resize.ShrinkDoesNotFit as exc:
                raise KvResizeError(str(exc), status=409) from exc
        result = KvResize(
            "resize",
            old_tokens,
            tokens,
            old_bytes,
            self.pool.committed_bytes,
            self._recap(runner, tokens),
            (time.perf_counter() - started) * 1e3,
            moved.moved_pages,
            moved.moved_window_pages,
            moved.copied_bytes,
            evicted_tokens,
            retracted_requests,
        )
        self._record(result)
        return result

    def _grow_kv(self, runner: ModelRunner, old_tokens: int, tokens: int) -> None:
        """Commit on every rank or on none: a rank that could not back it makes all give it back."""
        error: CommitError | None = None
        try:
            kv_resize.grow(runner, tokens)
        except CommitError as exc:
            error = exc
        if agree_min(int(error is None), self.group):
            return
        if error is None:
            kv_resize.shrink(runner, old_tokens)  # nothing was handed out above old_tokens yet
        reason = error or "another tensor-parallel rank ran out of memory"
        raise KvResizeError(
            f"could not back {tokens} KV tokens ({reason}); free device memory or ask for fewer", status=409
        )

    def _record(self, change: KvResize) -> None:
        """The change in the report (max_total_num_tokens, max_running_requests, a fresh ledger), the
        history and the log."""
        self.report = replace(
            self.report,
            max_total_num_tokens=change.to_tokens,
            max_running_requests=change.max_running_requests,
            ledger=self._measure_ledger(),
        )
        self.kv_events.append(change)
        self.kv_event_count += 1
        self._log("%s", change.log_line())

    def kv_info(self) -> KvCacheView:
        """The KV cache now and what a resize would need (rank 0's view; no collective)."""
        pool = self.pool
        allocator = self.runner.allocator if self.runner is not None else None
        capacity = allocator.capacity_tokens if allocator is not None else 0
        available = allocator.available_tokens if allocator is not None else 0
        limits = self.kv_limits()
        free = self.memory.mem_get_info()[0]
        kv_cap = self._kv_cap_bytes(pool, self.headroom_bytes)
        fits_now = tokens_for_budget(pool, free, self.headroom_bytes, self.args.max_total_tokens, kv_cap)
        return KvCacheView(
            max_total_num_tokens=pool.committed_tokens,
            capacity_tokens=capacity,
            available_tokens=available,
            page_size=self._page_size,
            committed_bytes=pool.committed_bytes,
            reserved_bytes=pool.reserved_bytes,
            reserved_tokens=pool.reserved_tokens,
            bytes_per_token=pool.bytes_per_token,
            chunk_bytes=pool.arena.chunk_bytes,
            granularity_bytes=pool.arena.vmm.granularity_bytes,
            min_tokens=limits.min_tokens,
            max_tokens=limits.max_tokens,
            max_tokens_bytes=pool.bytes_for_tokens(limits.max_tokens),
            max_total_tokens=self.args.max_total_tokens,
            max_device_memory_gib=self.args.max_device_memory_gib,
            cap_tokens=limits.cap_tokens,
            device_free_bytes=free,
            headroom_bytes=self.headroom_bytes,
            tokens_fitting_free_memory=fits_now,
            max_running_requests=self.report.max_running_requests,
            resizable=self.mode is SizingMode.POST_CAPTURE and not isinstance(self.memory, PlainMemory),
            sleeping_tags=self.sleeping_tags,
            events=tuple(self.kv_events),
        )

    def sleep_state(self) -> SleepState:
        weights = self.loaded.weights
        return SleepState(
            sleeping_tags=self.sleeping_tags,
            level=self.sleep_level if "weights" in self.sleeping_tags else None,
            weights_in_host_memory=weights is not None and weights.holds_host_copy,
            kv_committed_bytes=self.pool.committed_bytes,
            weights_committed_bytes=weights.committed_bytes if weights is not None else None,
        )

    # -- sleep and wake ---------------------------------------------------------------------
    def check_sleep(self, level: int, tags: Collection[str] | None) -> frozenset[str]:
        """The tags a sleep at `level` releases, or `KvResizeError` saying why it cannot."""
        if level not in (1, 2):
            raise KvResizeError(
                f"level must be 1 (weights kept in host memory) or 2 (weights dropped), got {level!r}",
                param="level",
            )
        chosen = self._check_tags(tags)
        if self.mode is not SizingMode.POST_CAPTURE or self.loaded.weights is None:
            raise KvResizeError(
                f"this engine sized its KV cache with --kv-sizing {self.mode}, which keeps the weights and the "
                "KV cache in torch's allocator; start it with --kv-sizing post-capture to sleep",
                status=409,
            )
        return chosen

    @staticmethod
    def _check_tags(
        tags: Collection[str] | None, default: frozenset[str] = DEFAULT_SLEEP_TAGS
    ) -> frozenset[str]:
        """The tags to act on (none given: `default`)."""
        if not tags:
            return default
        given = frozenset(tags)
        unknown = sorted(given - SLEEP_TAGS)
        if unknown:
            names = ", ".join(sorted(SLEEP_TAGS))
            raise KvResizeError(f"unknown tag(s) {', '.join(unknown)}; tags are {names}", param="tags")
        return given

    def sleep(self, level: int = 1, tags: Collection[str] | None = None) -> KvResize:
        """Release the KV cache and/or the weights (`tags`, default both) and, if `cuda_graph` is
        named, the captured graphs; every KV slot must be free when the KV cache goes (the
        scheduler's elastic module retracts first). Level 1 copies the weights to host memory,
        level 2 drops them (wake reloads them from the model files). Kept graphs stay valid:
        weights and KV come back at the same addresses."""
        chosen = self.check_sleep(level, tags) - self.sleeping_tags
        runner = self.runner
        if runner is None:
            raise KvResizeError("the engine is closed", status=409)
        allocator = runner.allocator
        if "kv_cache" in chosen and allocator.available_tokens != allocator.capacity_tokens:
            raise KvResizeError(
                f"{allocator.capacity_tokens - allocator.available_tokens} KV tokens are still held; finish or "
                "retract the requests and empty the prefix cache before the KV cache sleeps",
                status=409,
            )
        started = time.perf_counter()
        old_tokens, old_bytes = self.pool.committed_tokens, self.pool.committed_bytes
        if "kv_cache" in chosen:
            kv_resize.release(runner)
            self._history_vocab = runner.release_token_history()  # rows are set again on prefill
        if "cuda_graph" in chosen:
            runner.release_graphs()
            self._graph_driver_bytes = 0
        if "weights" in chosen and self.loaded.weights is not None:
            self.loaded.weights.offload(keep=level == 1)
            self.sleep_level = level
        settle(self.device)
        self.sleeping_tags |= chosen
        tokens = 0 if "kv_cache" in self.sleeping_tags else old_tokens
        change = KvResize(
            "sleep",
            old_tokens,
            tokens,
            old_bytes,
            self.pool.committed_bytes,
            self.report.max_running_requests,
            (time.perf_counter() - started) * 1e3,
        )
        self._record(change)
        return change

    def wake_up(self, tags: Collection[str] | None = None) -> KvResize:
        """Take back what sleep released (`tags`, default all), in `WAKE_ORDER`. The weights return
        at their addresses (copied back, or loaded again after level 2); released graphs are
        captured again; the KV cache is sized again from free memory measured now (MIN over ranks,
        less the headroom, under the caps), not the old number, and committed at its old
        addresses, so kept graphs run as they are."""
        chosen = self._check_tags(tags, default=SLEEP_TAGS) & self.sleeping_tags
        left = self.sleeping_tags - chosen
        for index, tag in enumerate(WAKE_ORDER):
            before = [earlier for earlier in WAKE_ORDER[:index] if earlier in left]
            if tag in chosen and before:
                raise KvResizeError(
                    f"wake {before[0]} before {tag} ({tag} is captured or sized from what the ones before it "
                    f"leave free): pass tags={before[0]} first, or both",
                    status=409,
                    param="tags",
                )
        runner = self.runner
        if runner is None:
            raise KvResizeError("the engine is closed", status=409)
        started = time.perf_counter()
        weights = self.loaded.weights
        if "weights" in chosen and weights is not None and not weights.restore():
            with use_tensor_parallel(self.tp):  # level 2: the same files (or seed) again
                fill_weights(self.loaded)
        if "cuda_graph" in chosen:
            if "kv_cache" in self.sleeping_tags:
                self.pool.ensure_prefix()  # graphs write their padding rows' K/V to the dummy page
            self._graph_driver_bytes, _ = self._capture(runner)
        tokens, max_running = self.pool.committed_tokens, self.report.max_running_requests
        if "kv_cache" in chosen:
            runner.restore_token_history(self._history_vocab)
            tokens = self._back_kv_again(runner)
            max_running = self._recap(runner, tokens)
        self.sleeping_tags -= chosen
        change = KvResize(
            "wake",
            0,
            tokens,
            0,
            self.pool.committed_bytes,
            max_running,
            (time.perf_counter() - started) * 1e3,
        )
        self._record(change)
        return change

    def _back_kv_again(self, runner: ModelRunner) -> int:
        try:
            self.pool.ensure_prefix()
        except CommitError as exc:  # not even the dummy page fits: a 409, not a server error
            self.pool.release_backing()
            raise KvResizeError(
                f"no memory to wake the KV cache into ({exc}); free device memory and wake again", status=409
            ) from exc
        free = measure_free(self.memory, self.group)
        kv_cap = self._kv_cap_bytes(self.pool, self.headroom_bytes)
        tokens = agree_min(
            tokens_for_budget(
                self.pool, free.min_bytes, self.headroom_bytes, self.args.max_total_tokens, kv_cap
            ),
            self.group,
        )
        if tokens < 2 * self._page_size:
            self.pool.release_backing()
            raise KvResizeError(
                f"no memory to wake the KV cache into: {free.min_bytes / GIB:.2f} GiB free, "
                f"{self.headroom_bytes / GIB:.2f} GiB kept as activation headroom; free device memory and wake again",
                status=409,
            )
        try:
            tokens, _ = finalize_with_retry(self.pool, tokens, self.group)
        except SizingError as exc:  # memory taken meanwhile, on some rank: every rank stays asleep
            self.pool.release_backing()
            raise KvResizeError(str(exc), status=409) from exc
        runner.allocator.resize(tokens)
        return tokens
