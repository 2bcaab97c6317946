"""The engine: its start-up pipeline (load, reserve, capture, measure, size, commit, report) and
the run-time changes of its memory (resize, sleep, wake), with the captured graphs kept valid.

`Engine.__init__` is the whole start-up pipeline in order; read it top to bottom. In
post-capture mode the KV pool is virtual addresses only until after the decode graphs are
captured; then the activation peak of the largest eager step is measured, and the KV sizing
object (snugkv.engine.kv_sizing: `KvSizing.size_after_capture`, the post-capture step) measures
free memory (MIN over ranks) and backs exactly what is left. The static modes size the pool
before capture, as classic engines do, for comparison and as the fallback without VMM.
From then on the runner serves like a statically sized one; the same sizing object resizes the
KV cache at run time and sizes it again on wake (snugkv.engine.sleep), without capturing a graph
again, and `--max-device-memory` caps the whole engine at start-up and on every change. Each
change is recorded in the report (with a fresh ledger), the history and the log.

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

from snugkv.core.forward import BatchRow
from snugkv.core.gc_pauses import freeze_startup_objects, thaw
from snugkv.core.process_clock import process_age_s
from snugkv.core.reports import KvCacheView, KvResize, MemoryLedger, SleepState, StartupReport
from snugkv.core.sampling import MAX_LOGPROBS, PROMPT_LOGITS_PER_STEP, SamplingParams
from snugkv.core.structured_output import TokenBitmask
from snugkv.distributed.group import TensorParallel, use_tensor_parallel
from snugkv.engine.args import EngineArgs
from snugkv.engine.kv_sizing import KvCaps, KvSizing, KvTarget, StartGate, StartupSizing
from snugkv.engine.sleep import EngineSleep
from snugkv.layers.logprobs import score_tokens
from snugkv.memory.host_device import SharedHostDevice
from snugkv.memory.kv_pool import KVPool, KVPoolSpec, PoolMode
from snugkv.memory.moves import KvMoves
from snugkv.memory.vmm import GIB, MIB, CommitError, VirtualMemory
from snugkv.memory.vmm_factory import create_vmm
from snugkv.memory.vmm_host import HostVmm, available_ram_bytes
from snugkv.memory.vmm_plain import PlainMemory
from snugkv.models.loader import LoadedModel, load_model, resolve_device
from snugkv.runner.cuda_graph import default_cuda_graph_batch_sizes, release_cublas_workspaces
from snugkv.runner.kv_cache import make_kv_pool
from snugkv.runner.kv_resize import load_shrink_kernels
from snugkv.runner.model_runner import ModelRunner
from snugkv.runner.piecewise_graphs import default_token_buckets
from snugkv.sizing.ledger import measure_ledger
from snugkv.sizing.measure import (
    agree_min,
    device_memory,
    engine_device_bytes,
    measure_capture,
    measure_free,
    measure_peak_bytes,
    settle,
    torch_reserved_bytes,
)
from snugkv.sizing.modes import (
    SizingMode,
    profiled_kv_budget_bytes,
    resolve_mode,
    static_fraction_budget,
    static_kv_tokens,
)
from snugkv.sizing.post_capture import SizingError
from snugkv.sizing.resize import KvResizeError
from snugkv.structured.bitmask import bitmask_words

logger = logging.getLogger(__name__)


class Engine:
    """One rank's model, KV cache and graphs: started in `__init__`, changed by `resize_kv`,
    `sleep` and `wake_up` between steps, released by `close`."""

    runner: ModelRunner | None  # None once closed
    kv: KvSizing  # the KV cache's size: pool, caps, headroom

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
        if args.tp_size != tp.world_size:
            raise ValueError(
                f"--tp {args.tp_size} needs one engine per rank: start it through "
                f"snugkv.distributed.launch (this process is rank {tp.rank} of {tp.world_size})"
            )
        group = group if group is not None or not tp.enabled else tp.cpu_group
        # The first line the engine logs: what comes before it in a start-up is imports (and the
        # spawn of an engine process), which scripts/startup_check.py times by it.
        self._log(
            "Starting the engine: model=%s, device=%s", args.model or "the default", args.device or "auto"
        )
        self.device = resolve_device(args.device)
        if self.device.type == "cuda" and (self.device.index is None or tp.enabled):
            self.device = torch.device("cuda", torch.cuda.current_device())  # tp: the launcher pinned it
        args.validate()
        self.args = args = args.resolved(self.device)
        self.group = group
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.zeros(1, device=self.device)  # CUDA context first, so the baseline includes it
        loading = time.perf_counter()
        self._timings["device_init_s"] = loading - started

        # 1. Load weights (baseline before, so the ledger can tell them apart). Post-capture places
        # them in virtual memory too, so sleep can release them without breaking a graph.
        self.mode = resolve_mode(args.kv_sizing, self.device)
        baseline_free, _ = device_memory(self.device)
        # What torch held before the engine (other tensors of this process) is not the engine's.
        self.baseline_reserved_bytes = torch_reserved_bytes(self.device)
        with use_tensor_parallel(tp):  # the model is built sharded for this rank
            self.loaded: LoadedModel = load_model(
                args.model,
                load_format=args.load_format,
                dtype=args.dtype,
                device=self.device,
                seed=args.weights_seed,
                max_position=args.context_length,
                revision=args.revision,
                weights_memory=self._weights_memory(),
                quantization=args.quantization,
            )
        if tp.enabled and not self.loaded.model.supports_tensor_parallel:
            raise ValueError(
                f"{self.loaded.config.architecture} does not support --tp yet; run it with --tp 1"
            )
        self.config = self.loaded.config
        self.kv_dtype = args.kv_dtype or self.loaded.dtype
        self.context_length = args.context_length or self.config.max_position_embeddings
        self._timings["load_s"] = time.perf_counter() - loading

        self.memory = self._memory_backend()
        self.baseline_free_bytes = baseline_free
        self._graph_driver_bytes = 0  # set once the graphs are captured
        self._activation_peak_bytes = 0  # measured before the KV cache is sized
        self._start_gate = start_gate
        # 2.-7. Reserve, capture, measure, size, commit (`KvSizing.size_after_capture`).
        sized = self._start_post_capture() if self.mode is SizingMode.POST_CAPTURE else self._start_static()
        self.runner = self.kv.runner
        self.sleeper = EngineSleep(
            mode=self.mode,
            loaded=self.loaded,
            kv=self.kv,
            tp=tp,
            device=self.device,
            capture_graphs=lambda: self._capture_graphs(self.kv.runner),
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

    @property
    def pool(self) -> KVPool:
        return self.kv.pool

    @property
    def headroom_bytes(self) -> int:
        """Device memory kept free for the activations of the largest eager step (0 on CPU)."""
        return self.kv.headroom_bytes

    @property
    def page_size(self) -> int:
        return self._page_size

    def _measure_ledger(self) -> MemoryLedger:
        return measure_ledger(
            self.device,
            self.memory,
            baseline_free_bytes=self.baseline_free_bytes,
            weights_bytes=sum(p.numel() * p.element_size() for p in self.loaded.model.parameters()),
            kv_committed_bytes=self.pool.committed_bytes,
            kv_reserved_va_bytes=self.pool.arena.reserved_bytes,
            kv_in_torch_allocator=isinstance(self.memory, PlainMemory),
            weights_in_torch_allocator=self.loaded.weights is None,
            weights_resident=self.loaded.weights is None or self.loaded.weights.resident,
            graph_executables_bytes=self._graph_driver_bytes,
            activation_peak_bytes=self._activation_peak_bytes,
            headroom_bytes=self.headroom_bytes,
            guest_room_bytes=self.kv.guest_room_bytes,
        )

    def _log(self, message: str, *args: Any) -> None:
        """Info on rank 0 only: one sizing line and one ledger per engine, not one per rank."""
        logger.log(logging.INFO if self.tp.is_first_rank else logging.DEBUG, message, *args)

    # -- memory backend -----------------------------------------------------------------
    def _memory_backend(self) -> VirtualMemory:
        if self.device.type == "cpu":
            # SNUGKV_HOST_DEVICE_GIB: one simulated device shared with other processes (multi-engine)
            return HostVmm(capacity_bytes=self._host_kv_bytes(), shared=SharedHostDevice.from_env())
        if self.mode is SizingMode.POST_CAPTURE:
            return create_vmm(self.device)
        return PlainMemory(self.device)

    def _weights_memory(self) -> VirtualMemory | None:
        """Virtual memory for the weights where the KV cache has it too (post-capture); on CPU an
        mmap backend of its own, so the weights never count against the KV budget."""
        if self.mode is not SizingMode.POST_CAPTURE:
            return None
        return HostVmm() if self.device.type == "cpu" else create_vmm(self.device)

    @staticmethod
    def _host_headroom() -> int:
        """The host keeps no activation headroom (activations come from general RAM), except on a
        simulated shared device told to keep some (memory-pressure tests)."""
        shared = SharedHostDevice.from_env()
        return shared.headroom_bytes if shared is not None else 0

    def _host_kv_bytes(self) -> int:
        if self.args.host_kv_gib is not None:
            return int(self.args.host_kv_gib * GIB)
        return min(GIB, available_ram_bytes() // 4)

    # -- building blocks ----------------------------------------------------------------
    def _pool(self, mode: PoolMode, reserved_tokens: int) -> KVPool:
        spec = KVPoolSpec.of(
            dtype=self.kv_dtype,
            page_size=self._page_size,
            layout=self.args.kv_layout,
            device=self.device,
            mode=mode,
            memory=self.memory,
            chunk_bytes=None if self.args.kv_chunk_mib is None else round(self.args.kv_chunk_mib * MIB),
        )
        return make_kv_pool(
            self.config,
            spec,
            reserved_tokens=reserved_tokens,
            swa_full_tokens_ratio=self.args.swa_full_tokens_ratio,
            num_kv_heads=self.loaded.model.num_kv_heads_per_rank,  # tp: this rank's
        )

    def _build_runner(self, pool: KVPool) -> ModelRunner:
        try:
            return ModelRunner.build(
                self.loaded.model,
                pool,
                max_requests=self._max_running_requests,
                max_context_len=self.context_length,
                attention_backend=self._attention_backend,
                tp=self.tp,
            )
        except CommitError as exc:
            raise SizingError(
                f"could not back even the KV cache's first page ({exc}); free some memory"
                + (" or raise --host-kv-gib" if self.device.type == "cpu" else "")
            ) from exc

    @property
    def _page_size(self) -> int:
        assert self.args.page_size is not None  # filled by EngineArgs.resolved
        return self.args.page_size

    @property
    def _max_running_requests(self) -> int:
        assert self.args.max_running_requests is not None  # filled by EngineArgs.resolved
        return self.args.max_running_requests

    @property
    def _chunked_prefill_size(self) -> int:
        assert self.args.chunked_prefill_size is not None  # filled by EngineArgs.resolved
        return self.args.chunked_prefill_size

    @property
    def _attention_backend(self) -> str:
        assert self.args.attention_backend is not None  # filled by EngineArgs.resolved
        return self.args.attention_backend

    def _graph_batch_sizes(self) -> list[int]:
        if self.args.disable_cuda_graph or not self.args.cuda_graph_max_bs:
            return []
        largest = min(self.args.cuda_graph_max_bs, self._max_running_requests)
        return default_cuda_graph_batch_sizes(largest)

    def _prefill_graph_buckets(self) -> list[int]:
        if self.args.disable_cuda_graph or not self.args.prefill_graph_max_tokens:
            return []
        return default_token_buckets(min(self.args.prefill_graph_max_tokens, self.context_length))

    def _capture_graphs(self, runner: ModelRunner) -> dict[str, float]:
        """Capture the decode graphs and the piecewise prefill graphs; counts the driver memory
        they took outside torch's allocator (the ledger's own item) and returns the seconds each
        kind took (`capture_decode_s`, `capture_piecewise_s`; `capture_s`: both and the measuring
        around them)."""
        sizes, buckets = self._graph_batch_sizes(), self._prefill_graph_buckets()
        timings = {"capture_decode_s": 0.0, "capture_piecewise_s": 0.0, "capture_s": 0.0}
        if not sizes and not buckets:
            self._graph_driver_bytes = 0
            return timings

        def capture() -> None:
            decode = time.perf_counter()
            if sizes:
                runner.capture_cuda_graphs(sizes)
            piecewise = time.perf_counter()
            if buckets:
                runner.capture_piecewise_graphs(buckets)
            timings["capture_decode_s"] = piecewise - decode
            timings["capture_piecewise_s"] = time.perf_counter() - piecewise

        started = time.perf_counter()
        self._graph_driver_bytes = measure_capture(self.device, capture).driver_bytes
        timings["capture_s"] = time.perf_counter() - started
        return timings

    def _release_graphs(self) -> None:
        """Drop every graph and its pool (sleep with `cuda_graph`)."""
        if self.runner is not None:
            self.runner.release_graphs()
        self._graph_driver_bytes = 0

    def _largest_eager_step(self, runner: ModelRunner) -> None:
        """The biggest eager work the engine will run: the largest prefill chunk (scoring the most
        prompt positions a step scores), decode beyond the graphs, and the sampler with every stage
        (penalties and a grammar's token mask included) over the largest batch, on the dummy slot
        only; then a shrink's kernels, loaded on the dummy page.

        Row 0 of the table is the padding row (all zeros), so every token reads and writes
        slot 0: this runs before any KV beyond the dummy page is backed.
        """
        # Sampling with every stage on: penalties also make the runner's per-row token history,
        # which then stays (allocated before the KV cache is sized, so the sizing counts it).
        sampling = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05)
        penalised = replace(sampling, repetition_penalty=1.1, min_tokens=1)
        if self.device.type != "cuda":
            # The host backend keeps no activation headroom (measure_peak_bytes is 0 there): only
            # what the step leaves behind is made, not its forward (seconds of every CPU start).
            runner.sample_on_device(torch.zeros(1, self.config.vocab_size), [penalised], None, [0])
            return
        chunk = min(self._chunked_prefill_size, self.context_length)
        scored = min(chunk, PROMPT_LOGITS_PER_STEP)  # a prompt being scored: logits for each position
        rows = [BatchRow(0, 0, [0] * scored, prompt_logits=True)]
        if chunk > scored:
            rows.append(BatchRow(0, 0, [0] * (chunk - scored)))
        logits = runner.forward(rows, torch.zeros(chunk, dtype=torch.int64, device=self.device))
        score_tokens(
            logits, torch.zeros(logits.shape[0], dtype=torch.int64, device=self.device), MAX_LOGPROBS
        )
        runner.sample(logits[-1:], [sampling])
        sizes = self._graph_batch_sizes()
        batch = self._max_running_requests
        if not sizes or batch > max(sizes):
            rows = [BatchRow(0, 1, [0])] * batch
            logits = runner.forward(rows, torch.zeros(batch, dtype=torch.int64, device=self.device))
        else:  # graph decode: its logits live in the graph pool; sampling them runs eagerly
            logits = torch.randn(batch, self.config.vocab_size, device=self.device)
        # Every row constrained by a grammar (all tokens allowed): the mask's unpacked bits and the
        # masked copy of the logits are as large as the logits, part of the peak of a structured batch.
        every_row = torch.arange(batch, dtype=torch.int64, device=self.device)
        allow_all = torch.full(
            (batch, bitmask_words(self.config.vocab_size)), -1, dtype=torch.int32, device=self.device
        )
        runner.sample_on_device(
            logits, [penalised] * batch, None, [0] * batch, token_bitmask=TokenBitmask(every_row, allow_all)
        )  # row 0: the padding row
        load_shrink_kernels(runner)

    # -- post-capture -------------------------------------------------------------------
    def _start_post_capture(self) -> StartupSizing:
        page = self._page_size
        reserving = time.perf_counter()
        # 2. Reserve: an upper bound from all free memory, no graph or activation reserve.
        free = measure_free(self.memory, self.group)
        probe = self._pool(PoolMode.POST_CAPTURE, page * 1024)
        bytes_per_token = probe.bytes_per_token
        probe.close()
        # The reserve bounds every later grow: an engine that starts beside others (--kv-elastic)
        # reserves more than is free now (--kv-reserve-gib), to grow into what they give back.
        reserve_bytes = int(self.args.kv_reserve_gib * GIB) if self.args.kv_reserve_gib else free.min_bytes
        reserved_tokens = max(int(reserve_bytes // bytes_per_token), page)
        if self.args.max_total_tokens:
            reserved_tokens = min(reserved_tokens, self.args.max_total_tokens + page)
        pool = self._pool(PoolMode.POST_CAPTURE, reserved_tokens)
        # 3. Back the dummy page, 4. capture the decode graphs against the fixed addresses.
        runner = self._build_runner(pool)
        self._timings["reserve_s"] = time.perf_counter() - reserving
        self._timings.update(self._capture_graphs(runner))
        # 5. Measure the activation peak of the largest eager step; it and the margin stay free.
        peaking = time.perf_counter()
        peak = measure_peak_bytes(self.device, lambda: self._largest_eager_step(runner))
        self._activation_peak_bytes = peak
        self._timings["activation_peak_s"] = time.perf_counter() - peaking
        headroom = (
            peak + self.args.headroom_margin_mib * MIB
            if self.device.type == "cuda"
            else self._host_headroom()
        )
        # 6. Measure free memory, size, commit (with retry), 7. resize the allocators, re-cap.
        self.kv = self._kv_sizing(runner, headroom)
        sized = self.kv.size_after_capture()
        free_after = self.memory.mem_get_info()[0]
        self._log(
            "Post-capture KV sizing: max_total_num_tokens=%d, committed=%.2f GiB, headroom=%.2f GiB, "
            "guest room=%.2f GiB, free after=%.2f GiB, took=%.1f ms%s",
            sized.max_total_num_tokens,
            pool.committed_bytes / GIB,
            headroom / GIB,
            self.kv.guest_room_bytes / GIB,
            free_after / GIB,
            sized.sizing_ms,
            self._per_rank_text(sized.per_rank_free_bytes),
        )
        return sized

    def _kv_sizing(self, runner: ModelRunner, headroom_bytes: int) -> KvSizing:
        pool = runner.kv_pool
        post_capture = self.mode is SizingMode.POST_CAPTURE  # the static modes leave no room
        guest_room = (self.args.guest_room_mib or 0) * MIB if post_capture else 0
        return KvSizing(
            runner,
            mode=self.mode,
            memory=self.memory,
            group=self.group,
            caps=KvCaps(
                page_size=self._page_size,
                max_total_tokens=self.args.max_total_tokens,
                max_device_memory_gib=self.args.max_device_memory_gib,
                max_running_requests=self._max_running_requests,
            ),
            headroom_bytes=headroom_bytes,
            workspace_bytes=self._activation_peak_bytes,
            held_besides_kv=lambda: self._engine_device_bytes(pool) - pool.committed_bytes,
            guest_room_bytes=guest_room,
            device_type=self.device.type,
            start_gate=self._start_gate,
        )

    @staticmethod
    def _per_rank_text(per_rank: tuple[int, ...]) -> str:
        if len(per_rank) <= 1:
            return ""
        return ", free per rank=[" + ", ".join(f"{value / GIB:.2f}" for value in per_rank) + "] GiB"

    def _engine_device_bytes(self, pool: KVPool | None) -> int:
        """What `--max-device-memory` counts: the engine's own device memory (weights, graphs,
        buffers, KV), not the CUDA context nor other processes."""
        outside_torch = self._graph_driver_bytes
        if pool is not None and not isinstance(self.memory, PlainMemory):
            outside_torch += pool.committed_bytes
        if self.loaded.weights is not None:
            outside_torch += self.loaded.weights.committed_bytes
        return engine_device_bytes(self.memory, outside_torch, self.baseline_reserved_bytes)

    # -- static modes -------------------------------------------------------------------
    def _start_static(self) -> StartupSizing:
        """Profiled / static-fraction: size KV before capture, as classic engines do."""
        page = self._page_size
        pages = max(2, self._chunked_prefill_size // page + 1)
        probe = self._pool(PoolMode.STATIC, pages * page)
        peaking = time.perf_counter()
        peak = self._profile_peak(probe)
        self._activation_peak_bytes = peak
        self._timings["activation_peak_s"] = time.perf_counter() - peaking
        bytes_per_token = probe.bytes_per_token
        probe.close()
        settle(self.device)
        measured = time.perf_counter()
        free, total = self.memory.mem_get_info()
        if self.mode is SizingMode.PROFILED:
            budget = profiled_kv_budget_bytes(
                total_bytes=total,
                used_bytes=total - free,
                activation_peak_bytes=peak,
                gpu_memory_utilization=self.args.gpu_memory_utilization,
            )
        else:
            budget = static_fraction_budget(
                total_bytes=total,
                used_bytes=total - free,
                chunked_prefill_tokens=self._chunked_prefill_size,
                max_graph_batch=max(self._graph_batch_sizes(), default=0),
                mem_fraction_static=self.args.mem_fraction_static,
            ).kv_budget_bytes
        if self.args.max_device_memory_gib is not None:  # the cap: what the engine holds now plus KV and peak
            cap_bytes = int(self.args.max_device_memory_gib * GIB)
            used = self._engine_device_bytes(pool=None)
            budget = min(budget, cap_bytes - used - peak)
        tokens = static_kv_tokens(budget, bytes_per_token, page, self.args.max_total_tokens)
        tokens = agree_min(tokens, self.group)  # tp: every rank the same count
        if tokens <= 0:
            raise SizingError(
                f"--kv-sizing {self.mode} leaves no memory for the KV cache ({budget / GIB:.2f} GiB budget); "
                "raise --gpu-memory-utilization / --mem-fraction-static"
                + (" / --max-device-memory" if self.args.max_device_memory_gib is not None else "")
                + " or use post-capture sizing"
            )
        pool = self._pool(PoolMode.STATIC, tokens)
        runner = self._build_runner(pool)
        sizing_ms = (time.perf_counter() - measured) * 1e3
        self._timings.update(self._capture_graphs(runner))
        self.kv = self._kv_sizing(runner, headroom_bytes=0)  # the static modes keep no headroom
        self.kv.check_usable()
        max_running = self.kv.recap(pool.committed_tokens)
        self._log(
            "KV sizing (%s): max_total_num_tokens=%d, committed=%.2f GiB, budget=%.2f GiB, took=%.1f ms",
            self.mode,
            pool.committed_tokens,
            pool.committed_bytes / GIB,
            budget / GIB,
            sizing_ms,
        )
        return StartupSizing(
            pool.committed_tokens,
            max_running,
            retries=0,
            per_rank_free_bytes=(),
            sizing_ms=sizing_ms,
        )

    def _profile_peak(self, pool: KVPool) -> int:
        runner = self._build_runner(pool)
        return measure_peak_bytes(self.device, lambda: self._largest_eager_step(runner))

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
        return not self.args.no_kv_pressure and self._resize_refusal() is None

    def resize_kv(
        self,
        target: int | KvTarget,
        *,
        on_move: Callable[[KvMoves], None] | None = None,
        evicted_tokens: int = 0,
        retracted_requests: int = 0,
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
        what the scheduler freed for them, for the record).
        """
        if not isinstance(target, KvTarget):
            target = self.check_resizable().target(target)
        change = self.kv.resize(
            target,
            on_move=on_move,
            evicted_tokens=evicted_tokens,
            retracted_requests=retracted_requests,
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
        """Give the weights' memory back now, not when the last reference to the model goes: every
        parameter and buffer is emptied in place (a caller still holding the model, a module or a
        parameter object keeps an object of no elements), then the weight arena is released. A
        tensor still viewing the weights themselves keeps them: the arena then goes when that tensor
        does, and the log says so."""
        model = self.loaded.model
        with torch.no_grad():
            for tensor in (*model.parameters(), *model.buffers()):
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        if self.loaded.weights is None:
            return
        try:
            self.loaded.weights.close()
        except RuntimeError as exc:
            logger.warning("weights not released yet: %s", exc)
