"""The engine: its start-up pipeline (load, reserve, capture, measure, size, commit, report) and
the run-time changes of its memory (resize, sleep, wake), with the captured graphs kept valid.

`Engine.__init__` is the whole start-up pipeline in order; read it top to bottom. Each phase lives
in a module of its own: the memory backend (snugkv.engine.memory_backend), the building blocks the
phases share (snugkv.engine.blocks: pools, runners, the ledger), graph capture and the largest
eager step (snugkv.engine.capture), and the sizing itself, post-capture
(snugkv.engine.post_capture_start) or static (snugkv.engine.static_start). In post-capture mode
the KV pool is virtual addresses only until after the decode graphs are captured; then the
activation peak of the largest eager step is measured, and the KV sizing object
(snugkv.engine.kv_sizing: `KvSizing.size_after_capture`, the post-capture step) measures free
memory (MIN over ranks) and backs exactly what is left. The static modes size the pool before
capture, as classic engines do, for comparison and as the fallback without VMM.
From then on the runner serves like a statically sized one; the same sizing object resizes the
KV cache at run time and sizes it again on wake (snugkv.engine.sleep), without capturing a graph
again, and `--max-device-memory` caps the whole engine at start-up and on every change. Each
change is recorded in the report (with a fresh ledger), the history and the log; this module
owns that record and the shutdown, and never sizes the KV cache itself.

Tensor parallelism (`tp_size > 1`): every rank runs this same pipeline on its own GPU with its
slice of the model and a KV pool of its own KV heads; `tp` (snugkv.distributed) comes from the
launcher, its CPU group is the sizing group, and only rank 0 logs the sizing line and ledger.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from snugkv.core.gc_pauses import freeze_startup_objects, thaw
from snugkv.core.host_threads import limit_for_device
from snugkv.core.process_clock import process_age_s
from snugkv.core.reports import KvCacheView, KvResize, MemoryLedger, SleepState, StartupReport
from snugkv.distributed.group import TensorParallel, use_tensor_parallel
from snugkv.engine.args import EngineArgs, InvalidEngineArgs
from snugkv.engine.blocks import EngineBlocks
from snugkv.engine.capture import capture_graphs
from snugkv.engine.draft_model import draft_path, find_draft_source, load_draft_model
from snugkv.engine.host_tier import allocate_staging, open_host_tier
from snugkv.engine.kv_sizing import KvSizing, KvTarget, StartGate
from snugkv.engine.memory_backend import memory_backend, weights_memory
from snugkv.engine.post_capture_start import start_post_capture
from snugkv.engine.sleep import EngineSleep
from snugkv.engine.static_start import start_static
from snugkv.kernels import compile_workers
from snugkv.memory.host_tier import HostKvTier
from snugkv.memory.kv_pool import KVPool
from snugkv.memory.moves import KvMoves
from snugkv.models.eagle3 import is_eagle3
from snugkv.models.loader import LoadedModel, load_model, resolve_device
from snugkv.runner.cuda_graph import release_cublas_workspaces
from snugkv.runner.model_runner import ModelRunner
from snugkv.sizing.measure import device_memory, settle, torch_reserved_bytes
from snugkv.sizing.modes import SizingMode, resolve_mode
from snugkv.sizing.resize import KvResizeError

logger = logging.getLogger(__name__)


class Engine:
    """One rank's model, KV cache and graphs: started in `__init__`, changed by `resize_kv`,
    `sleep` and `wake_up` between steps, released by `close`."""

    runner: ModelRunner | None  # None once closed
    kv: KvSizing  # the KV cache's size: pool, caps, headroom
    host_tier: HostKvTier | None  # the prefix cache's second tier (None: off, or closed)

    def __init__(
        self,
        args: EngineArgs,
        group: dist.ProcessGroup | None = None,
        tp: TensorParallel | None = None,
        start_gate: StartGate | None = None,
    ) -> None:
        """`start_gate`: what bounds the KV cache at the start-up sizing point (`KvSizing`), None
        for all the free memory less the headroom."""
        started = time.perf_counter()
        # The start-up's phases in seconds (the report's `timings`); the first is how long this
        # process ran before the engine started (its imports; in an engine process, its spawn too).
        age_s = process_age_s()
        self._timings: dict[str, float] = {} if age_s is None else {"process_age_s": age_s}
        # Tensor parallel: this rank's groups; the CPU group is the sizing group (MIN over ranks).
        self.tp = tp = tp or TensorParallel()
        if args.parallel.tp_size != tp.world_size:
            raise ValueError(
                f"--tp {args.parallel.tp_size} needs one engine per rank: start it through "
                f"snugkv.distributed.launch (this process is rank {tp.rank} of {tp.world_size})"
            )
        group = group if group is not None or not tp.enabled else tp.cpu_group
        # The first line the engine logs: what comes before it in a start-up is imports (and the
        # spawn of an engine process), which scripts/startup_check.py times by it.
        self._log(
            "Starting the engine: model=%s, device=%s%s",
            args.load.model or "the default",
            args.parallel.device or "auto",
            "" if age_s is None else f" (this process started {age_s:.1f} s ago: its imports)",
        )
        self.device = resolve_device(args.parallel.device)
        if self.device.type == "cuda" and (self.device.index is None or tp.enabled):
            self.device = torch.device("cuda", torch.cuda.current_device())  # tp: the launcher pinned it
        self.args = args
        self.group = group
        if self.device.type == "cuda":
            # A cold start's Triton compiles, in processes beside this start (kernels/compile_ahead.py)
            compile_workers.start(ranks=tp.world_size)
            torch.cuda.set_device(self.device)
            torch.zeros(1, device=self.device)  # CUDA context first, so the baseline includes it
        loading = time.perf_counter()
        self._timings["device_init_s"] = loading - started

        # 1. Load weights (baseline before, so the ledger can tell them apart). Post-capture places
        # them in virtual memory too, so sleep can release them without breaking a graph.
        self.mode = resolve_mode(args.memory.kv_sizing, self.device)
        draft_source = find_draft_source(args, tp)  # a bad --draft-model path fails before any load
        baseline_free, _ = device_memory(self.device)
        # What torch held before the engine (other tensors of this process) is not the engine's.
        self.baseline_reserved_bytes = torch_reserved_bytes(self.device)
        with use_tensor_parallel(tp):  # the model is built sharded for this rank
            self.loaded: LoadedModel = load_model(
                args.load.model,
                load_format=args.load.load_format,
                dtype=args.load.dtype,
                device=self.device,
                seed=args.load.weights_seed,
                max_position=args.load.context_length,
                revision=args.load.revision,
                weights_memory=weights_memory(self.device, self.mode),
                quantization=args.load.quantization,
            )
        if tp.enabled and not self.loaded.model.supports_tensor_parallel:
            raise ValueError(
                f"{self.loaded.config.architecture} does not support --tp yet; run it with --tp 1"
            )
        self.config = self.loaded.config
        if is_eagle3(self.config):
            raise InvalidEngineArgs(
                f"{args.load.model} is an EAGLE-3 head, which drafts for a model and cannot serve alone; pass "
                "the model it was trained for as --model and this one as --speculative eagle --draft-model"
            )
        if args.speculative is not None and args.speculative.drafts_with_model:
            try:  # the layers a `--draft-model layers:N` may take are known once the model is
                args.speculative.draft_layers(self.config.num_layers)
            except ValueError as exc:
                raise InvalidEngineArgs(str(exc)) from None
        self.kv_dtype = args.cache.kv_dtype or self.loaded.dtype
        self.context_length = args.load.context_length or self.config.max_position_embeddings
        # A separate draft model (--draft-model PATH): its own weights, its KV beside the model's.
        self.draft: LoadedModel | None = None
        if draft_source is not None:
            self.draft = load_draft_model(
                args,
                draft_path(args) or "",
                draft_source,
                self.loaded,
                context_length=self.context_length,
                weights_memory=weights_memory(self.device, self.mode),
                tp=tp,
            )
        self._timings["load_s"] = time.perf_counter() - loading

        self.memory = memory_backend(self.device, self.mode, args)
        self.baseline_free_bytes = baseline_free
        self._blocks = EngineBlocks(
            args=args,
            mode=self.mode,
            device=self.device,
            tp=tp,
            group=group,
            loaded=self.loaded,
            draft=self.draft,
            kv_dtype=self.kv_dtype,
            context_length=self.context_length,
            memory=self.memory,
            baseline_free_bytes=baseline_free,
            baseline_reserved_bytes=self.baseline_reserved_bytes,
            start_gate=start_gate,
            log=self._log,
        )
        # The host tier's copy staging on the device: a fixed buffer, so before the KV cache is sized.
        staging = allocate_staging(args, self.device, tp.world_size)
        # 2.-7. Reserve, capture, measure, size, commit (`KvSizing.size_after_capture`).
        start = start_post_capture if self.mode is SizingMode.POST_CAPTURE else start_static
        try:
            self.kv, sized = start(self._blocks, self._timings)
        finally:
            compile_workers.stop()  # the start's kernels are compiled (or it failed)
        self.runner = self.kv.runner
        # The prefix cache's second tier, in (pinned) host memory beside the device's KV cache.
        self.host_tier = open_host_tier(
            args, self.kv.pool, self.device, ranks=tp.world_size, group=group, log=self._log, staging=staging
        )
        # without a tier its staging goes back to torch's cache (the ledger's workspace row)
        self._blocks.host_tier_staging_bytes = 0 if self.host_tier is None else self.host_tier.staging_bytes
        del staging
        self.sleeper = EngineSleep(
            mode=self.mode,
            loaded=self.loaded,
            draft=self.draft,
            kv=self.kv,
            tp=tp,
            device=self.device,
            capture_graphs=lambda: capture_graphs(self._blocks, self.kv.runner),
            release_graphs=self._release_graphs,
        )
        # 8. The report: the sizing figures and the ledger.
        ledger = self._measure_ledger()
        self.report = StartupReport(
            self.mode,
            sized.max_total_num_tokens,
            sized.max_running_requests,
            ledger=ledger,
            sizing_ms=sized.sizing_ms,
            retries=sized.retries,
            per_rank_free_bytes=sized.per_rank_free_bytes,
            timings={**self._timings, **sized.timings, "total_s": time.perf_counter() - started},
            quantization=self.loaded.quantization_name,
        )
        self._log("%s", ledger.table())
        freeze_startup_objects()  # a full collection no longer walks the model and the graphs
        limit_for_device(self.device)  # the scheduler's CPU ops on one thread (core.host_threads)

    @property
    def pool(self) -> KVPool:
        return self.kv.pool

    @property
    def headroom_bytes(self) -> int:
        """Device memory kept free for the activations of the largest eager step (0 on CPU)."""
        return self.kv.headroom_bytes

    @property
    def page_size(self) -> int:
        return self._blocks.page_size

    def _measure_ledger(self) -> MemoryLedger:
        ledger = self._blocks.measure_ledger(self.kv)
        tier = self.host_tier
        return ledger if tier is None else replace(ledger, host_tier_bytes=tier.capacity_bytes)

    def _log(self, message: str, *args: Any) -> None:
        """Info on rank 0 only: one sizing line and one ledger per engine, not one per rank."""
        logger.log(logging.INFO if self.tp.is_first_rank else logging.DEBUG, message, *args)

    def _release_graphs(self) -> None:
        """Drop every graph and its pool (sleep with `cuda_graph`)."""
        if self.runner is not None:
            self.runner.release_graphs()
        self._blocks.graph_driver_bytes = 0

    # -- run time: the KV cache's size, sleep and wake (the scheduler's thread, between steps) ----
    def _resize_refusal(self) -> KvResizeError | None:
        """Why the KV cache cannot change size now (closed, sized without virtual memory, asleep),
        or None: the one definition behind `check_resizable` and `watches_pressure`."""
        if self.runner is None:
            return KvResizeError("the engine is closed", status=409)
        if not self.kv.resizable:
            return KvResizeError(
                f"this engine sized its KV cache with --kv-sizing {self.mode}, whose memory cannot be given "
                "back; start it with --kv-sizing post-capture to resize at run time",
                status=409,
            )
        if self.sleeper.is_sleeping:
            return KvResizeError(
                "the engine is asleep (its KV cache is released); wake it first (POST /wake_up)", status=409
            )
        return None

    def check_resizable(self) -> KvSizing:
        """The KV sizing object, or `KvResizeError` saying why the KV cache cannot change size now."""
        refusal = self._resize_refusal()
        if refusal is not None:
            raise refusal
        return self.kv

    @property
    def watches_pressure(self) -> bool:
        """Whether memory pressure may resize the KV cache now: it can resize (`check_resizable`)
        and `--no-kv-pressure` was not given. The same answer on every rank."""
        return not self.args.memory.no_kv_pressure and self._resize_refusal() is None

    def resize_kv(
        self,
        target: int | KvTarget,
        *,
        on_move: Callable[[KvMoves], None] | None = None,
        evicted_tokens: int = 0,
        retracted_requests: int = 0,
        dropped_tokens: int = 0,
        room_ms: float = 0.0,
        reason: str = "resize",
        free_bytes: int | None = None,
    ) -> KvResize:
        """Grow or shrink the KV cache to `target` tokens; `reason` is what the record says moved
        it ("resize", "pressure", "pressure-grow"), with the free memory a pressure move was sized
        from (`free_bytes`).

        A plain count is checked here: `KvResizeError` when the engine cannot resize now or the
        count breaks a limit (named), else it is rounded down to whole pages. A `KvTarget` was
        checked when it was made (`KvSizing.target`), by a caller that checked the engine first and
        then made room for it (the scheduler's resize, the driver's pressure move): nothing is
        checked twice. Shrinking moves the pages in use above the new bound below it (`on_move`
        lets the prefix cache follow); they must fit (`evicted_tokens`/`retracted_requests` are
        what the scheduler freed for them, `dropped_tokens` the evicted ones kept nowhere and
        `room_ms` its time, for the record).
        """
        if not isinstance(target, KvTarget):
            target = self.check_resizable().target(target)
        change = self.kv.resize(
            target,
            on_move=on_move,
            evicted_tokens=evicted_tokens,
            retracted_requests=retracted_requests,
            dropped_tokens=dropped_tokens,
            room_ms=room_ms,
            reason=reason,
            free_bytes=free_bytes,
        )
        self._record(change)
        return change

    @property
    def is_sleeping(self) -> bool:
        return self.sleeper.is_sleeping

    @property
    def sleeping_tags(self) -> frozenset[str]:
        return self.sleeper.sleeping_tags

    @property
    def sleep_level(self) -> int:
        return self.sleeper.level

    def check_sleep(self, level: int, tags: Collection[str] | None) -> frozenset[str]:
        """The tags a sleep at `level` releases, or `KvResizeError` saying why it cannot."""
        return self.sleeper.check(level, tags)

    def sleep(self, level: int = 1, tags: Collection[str] | None = None) -> KvResize:
        """Release the KV cache and/or the weights (and the graphs, if `cuda_graph` is named);
        every KV slot must be free when the KV cache goes (snugkv.engine.sleep)."""
        if self.runner is None:
            raise KvResizeError("the engine is closed", status=409)
        change = self.sleeper.sleep(level, tags, max_running_requests=self.report.max_running_requests)
        self._record(change)
        return change

    def wake_up(self, tags: Collection[str] | None = None) -> KvResize:
        """Take back what sleep released (`tags`, default all); the KV cache is sized again from the
        free memory measured now (snugkv.engine.sleep)."""
        if self.runner is None:
            raise KvResizeError("the engine is closed", status=409)
        change = self.sleeper.wake_up(tags, max_running_requests=self.report.max_running_requests)
        self._record(change)
        return change

    def _record(self, change: KvResize) -> None:
        """The change in the report (max_total_num_tokens, max_running_requests, a fresh ledger), the
        history and the log."""
        self.report = replace(
            self.report,
            max_total_num_tokens=change.to_tokens,
            max_running_requests=change.max_running_requests,
            ledger=self._measure_ledger(),
        )
        self.kv.record(change)
        self._log("%s", change.log_line())

    @property
    def kv_events(self) -> tuple[KvResize, ...]:
        """The last resizes, sleeps and wakes, oldest first."""
        return tuple(self.kv.events)

    @property
    def kv_event_count(self) -> int:
        return self.kv.event_count

    def kv_info(self) -> KvCacheView:
        """The KV cache now and what a resize would need (this rank's view; no collective)."""
        return self.kv.view(
            max_running_requests=self.report.max_running_requests, sleeping_tags=self.sleeper.sleeping_tags
        )

    def sleep_state(self) -> SleepState:
        return self.sleeper.state()

    # -- shutdown -----------------------------------------------------------------------
    def close(self) -> None:
        """Release graphs, pool views and the arena, in that order; idempotent."""
        runner = self.runner
        if runner is None:
            return
        thaw()  # what the engine held becomes collectable again
        if self.host_tier is not None:  # it views the pool's buffers: before the pool goes
            self.host_tier.close()
            self.host_tier = None
        runner.close()
        self.runner = None
        if self.device.type == "cuda":
            release_cublas_workspaces()  # the eager GEMMs' cached workspaces since the last capture
        settle(self.device)
        try:
            self.pool.close()
            if not self.pool.owns_arena:
                self.pool.arena.close()
        except RuntimeError as exc:  # a caller still holds a KV tensor: the arena goes when it does
            logger.warning("KV arena not released yet: %s", exc)
        self._release_weights()

    def _release_weights(self) -> None:
        """Give the weights' memory back now (the draft model's too), not when the last reference to
        the model goes: every parameter and buffer is emptied in place (a caller still holding the
        model, a module or a parameter object keeps an object of no elements), then the weight arena
        is released. A tensor still viewing the weights themselves keeps them: the arena then goes
        when that tensor does, and the log says so."""
        for loaded in (self.loaded, self.draft):
            if loaded is None:
                continue
            with torch.no_grad():
                for tensor in (*loaded.model.parameters(), *loaded.model.buffers()):
                    tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
            if loaded.weights is None:
                continue
            try:
                loaded.weights.close()
            except RuntimeError as exc:
                logger.warning("weights not released yet: %s", exc)
