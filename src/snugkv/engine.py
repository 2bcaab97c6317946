"""The engine's start-up: load, reserve, capture, measure, size, commit, report.

`Engine.__init__` is the whole start-up pipeline in order; read it top to bottom. In
post-capture mode the KV pool is virtual addresses only until after the decode graphs are
captured; then free memory is measured (MIN over ranks), the activation peak of the largest
eager step is measured, and exactly what is left is backed. The static modes size the pool
before capture, as classic engines do, for comparison and as the fallback without VMM.
From `Engine.ready` on, the runner serves like a statically sized one.

Tensor parallelism (`tp_size > 1`): every rank runs this same pipeline on its own GPU with its
slice of the model and a KV pool of its own KV heads; `tp` (snugkv.distributed) comes from the
launcher, its CPU group is the sizing group, and only rank 0 logs the sizing line and ledger.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from snugkv.attention.registry import make_attention_backend
from snugkv.distributed.group import TensorParallel, use_tensor_parallel
from snugkv.layers.sampler import SamplingParams
from snugkv.memory.kv_pool import KVPool, PoolMode
from snugkv.memory.req_to_token import ReqToTokenPool
from snugkv.memory.vmm import GIB, MIB, CommitError, VirtualMemory, create_vmm
from snugkv.memory.vmm_host import HostVmm
from snugkv.memory.vmm_plain import PlainMemory
from snugkv.models.loader import LoadedModel, load_model, resolve_device
from snugkv.runner.cuda_graph import default_cuda_graph_batch_sizes
from snugkv.runner.forward_batch import BatchRow
from snugkv.runner.kv_cache import make_kv_pool, make_slot_allocator, resize_slot_allocator
from snugkv.runner.model_runner import ModelRunner
from snugkv.sizing.ledger import MemoryLedger
from snugkv.sizing.measure import agree_min, measure_free, measure_peak_bytes, settle
from snugkv.sizing.modes import SizingMode, profiled_kv_budget_bytes, resolve_mode, static_fraction_budget
from snugkv.sizing.post_capture import SizingError, recap_running_requests, size_post_capture

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Everything start-up needs. `None` means: pick the default for the device."""

    model: str | None = None
    load_format: str = "auto"
    dtype: str | None = None
    device: str | None = None
    weights_seed: int = 0  # random (dummy) weights only
    kv_dtype: str | None = None
    page_size: int | None = None
    kv_layout: str = "nhd"
    attention_backend: str | None = None
    kv_sizing: str | None = None
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    context_length: int | None = None
    chunked_prefill_size: int | None = None
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    gpu_memory_utilization: float = 0.9
    mem_fraction_static: float | None = None
    headroom_margin_mib: int = 256  # stated safety margin on top of the measured activation peak
    host_kv_gib: float | None = (
        None  # CPU: RAM the KV cache may take (default: 25% of free RAM, at most 1 GiB)
    )
    swa_full_tokens_ratio: float = 0.8
    tp_size: int = 1  # tensor-parallel ranks; > 1 runs one engine per rank (snugkv.distributed.launch)

    def validate(self) -> None:
        """Refuse values no engine can run with, naming the flag (before `resolved` fills defaults)."""
        if self.page_size is not None and self.page_size < 1:
            raise InvalidEngineArgs(f"--page-size must be at least 1, got {self.page_size}")
        page = self.page_size or 1
        if self.max_total_tokens is not None and self.max_total_tokens < 2 * page:
            at = f" at --page-size {page}" if self.page_size else ""
            raise InvalidEngineArgs(
                f"--max-total-tokens {self.max_total_tokens} is below two KV pages ({2 * page} tokens{at}); raise it"
            )
        if self.host_kv_gib is not None and self.host_kv_gib <= 0:
            raise InvalidEngineArgs(f"--host-kv-gib must be positive, got {self.host_kv_gib}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise InvalidEngineArgs(
                f"--max-running-requests must be at least 1, got {self.max_running_requests}"
            )

    def resolved(self, device: torch.device) -> EngineArgs:
        gpu = device.type == "cuda"
        return replace(
            self,
            page_size=self.page_size or (16 if gpu else 1),
            attention_backend=self.attention_backend or ("triton" if gpu else "torch"),
            max_running_requests=self.max_running_requests or (256 if gpu else 16),
            chunked_prefill_size=self.chunked_prefill_size or (8192 if gpu else 512),
            cuda_graph_max_bs=self.cuda_graph_max_bs or (256 if gpu else 0),
            disable_cuda_graph=self.disable_cuda_graph or not gpu,
        )


class InvalidEngineArgs(ValueError):
    """An engine flag out of range; the message names the flag and what to pass."""


@dataclass(slots=True)
class StartupReport:
    mode: SizingMode
    max_total_num_tokens: int
    max_running_requests: int
    ledger: MemoryLedger
    sizing_ms: float
    retries: int = 0
    per_rank_free_bytes: tuple[int, ...] = ()
    timings: dict[str, float] = field(default_factory=dict)  # keys carry their unit

    def to_dict(self) -> dict[str, Any]:
        return {
            "sizing_mode": str(self.mode),
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": self.max_running_requests,
            "sizing_ms": round(self.sizing_ms, 3),
            "retries": self.retries,
            "per_rank_free_bytes": list(self.per_rank_free_bytes),
            "memory_ledger": self.ledger.to_dict(),
            "timings": {key: round(value, 3) for key, value in self.timings.items()},
        }


class Engine:
    def __init__(
        self, args: EngineArgs, group: dist.ProcessGroup | None = None, tp: TensorParallel | None = None
    ) -> None:
        started = time.perf_counter()
        # Tensor parallel: this rank's groups; the CPU group is the sizing group (MIN over ranks).
        self.tp = tp = tp or TensorParallel()
        if args.tp_size != tp.world_size:
            raise ValueError(
                f"--tp {args.tp_size} needs one engine per rank: start it through "
                f"snugkv.distributed.launch (this process is rank {tp.rank} of {tp.world_size})"
            )
        group = group if group is not None or not tp.enabled else tp.cpu_group
        self.device = resolve_device(args.device)
        if self.device.type == "cuda" and (self.device.index is None or tp.enabled):
            self.device = torch.device("cuda", torch.cuda.current_device())  # tp: the launcher pinned it
        args.validate()
        self.args = args = args.resolved(self.device)
        self.group = group
        self._graph_driver_bytes = 0  # driver memory that graph capture took (set by _capture)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.zeros(1, device=self.device)  # CUDA context first, so the baseline includes it
        timings: dict[str, float] = {}

        # 1. Load weights (baseline before, so the ledger can tell them apart).
        baseline_free, total = self._device_mem_info()
        with use_tensor_parallel(tp):  # the model is built sharded for this rank
            self.loaded: LoadedModel = load_model(
                args.model,
                load_format=args.load_format,
                dtype=args.dtype,
                device=self.device,
                seed=args.weights_seed,
                max_position=args.context_length,
            )
        if tp.enabled and not getattr(self.loaded.model, "supports_tensor_parallel", False):
            raise ValueError(
                f"{self.loaded.config.architecture} does not support --tp yet; run it with --tp 1"
            )
        self.config = self.loaded.config
        self.kv_dtype = args.kv_dtype or self.loaded.dtype
        self.context_length = args.context_length or self.config.max_position_embeddings
        timings["load_s"] = time.perf_counter() - started

        self.mode = resolve_mode(args.kv_sizing, self.device, self.kv_dtype)
        self.memory = self._memory_backend()
        if self.mode is SizingMode.POST_CAPTURE:
            report = self._start_post_capture(timings)
        else:
            report = self._start_static(timings)
        report.ledger = self._ledger(baseline_free=baseline_free, total=total, report=report)
        timings["total_s"] = time.perf_counter() - started
        report.timings = timings
        self.report = report
        self._log("%s", report.ledger.table())

    def _log(self, message: str, *args: Any) -> None:
        """Info on rank 0 only: one sizing line and one ledger per engine, not one per rank."""
        logger.log(logging.INFO if self.tp.is_first_rank else logging.DEBUG, message, *args)

    # -- memory backend -----------------------------------------------------------------
    def _memory_backend(self) -> VirtualMemory:
        if self.device.type == "cpu":
            return HostVmm(capacity_bytes=self._host_kv_bytes())
        if self.mode is SizingMode.POST_CAPTURE:
            return create_vmm(self.device)
        return PlainMemory(self.device)

    def _host_kv_bytes(self) -> int:
        if self.args.host_kv_gib is not None:
            return int(self.args.host_kv_gib * GIB)
        from snugkv.memory.vmm_host import _available_ram_bytes

        return min(GIB, _available_ram_bytes() // 4)

    def _device_mem_info(self) -> tuple[int, int]:
        if self.device.type == "cuda":
            settle(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            return int(free), int(total)
        return 0, 0

    # -- building blocks ----------------------------------------------------------------
    def _build_runner(self, pool: KVPool, capacity_tokens: int) -> ModelRunner:
        try:
            pool.ensure_prefix()
        except CommitError as exc:
            raise SizingError(
                f"could not back even the KV cache's first page ({exc}); free some memory"
                + (" or raise --host-kv-gib" if self.device.type == "cpu" else "")
            ) from exc
        return ModelRunner(
            self.loaded.model,
            kv_pool=pool,
            req_to_token_pool=ReqToTokenPool(
                self.args.max_running_requests, self.context_length, self.device
            ),
            allocator=make_slot_allocator(pool, capacity_tokens, self.device),
            attn_backend=make_attention_backend(self.args.attention_backend),
            tp=self.tp,
        )

    def _pool(self, mode: PoolMode, max_num_tokens: int) -> KVPool:
        return make_kv_pool(
            self.config,
            kv_dtype=self.kv_dtype,
            page_size=self.args.page_size,
            layout=self.args.kv_layout,
            max_num_tokens=max_num_tokens,
            device=self.device,
            mode=mode,
            memory=self.memory,
            swa_full_tokens_ratio=self.args.swa_full_tokens_ratio,
            num_kv_heads=getattr(self.loaded.model, "num_kv_heads_per_rank", None),  # tp: this rank's
        )

    def _graph_batch_sizes(self) -> list[int]:
        if self.args.disable_cuda_graph:
            return []
        largest = min(self.args.cuda_graph_max_bs, self.args.max_running_requests)
        return default_cuda_graph_batch_sizes(largest)

    def _capture(self, runner: ModelRunner) -> int:
        """Capture the decode graphs; returns the free memory they took.

        Also records what the driver took outside torch's allocator (graph executables and the
        kernel modules loaded while capturing), which the ledger lists as its own item.
        """
        sizes = self._graph_batch_sizes()
        self._graph_driver_bytes = 0
        if not sizes:
            return 0
        before, _ = self._device_mem_info()
        reserved_before = torch.cuda.memory_reserved(self.device)
        runner.capture_cuda_graphs(sizes)
        after, _ = self._device_mem_info()
        reserved_growth = torch.cuda.memory_reserved(self.device) - reserved_before
        self._graph_driver_bytes = max(before - after - reserved_growth, 0)
        return before - after

    def _largest_eager_step(self, runner: ModelRunner) -> None:
        """The biggest eager work the engine will run: the largest prefill chunk, decode beyond the
        graphs, and the sampler over the largest batch with top-k and top-p, on the dummy slot only.

        Row 0 of the table is the padding row (all zeros), so every token reads and writes
        slot 0: this runs before any KV beyond the dummy page is backed.
        """
        sampling = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
        chunk = min(self.args.chunked_prefill_size, self.context_length)
        logits = runner.forward(
            [BatchRow(0, 0, [0] * chunk)], torch.zeros(chunk, dtype=torch.int64, device=self.device)
        )
        runner.sample(logits, [sampling])
        sizes = self._graph_batch_sizes()
        batch = self.args.max_running_requests
        if not sizes or batch > max(sizes):
            rows = [BatchRow(0, 1, [0])] * batch
            logits = runner.forward(rows, torch.zeros(batch, dtype=torch.int64, device=self.device))
        else:  # graph decode: its logits live in the graph pool; sampling them runs eagerly
            logits = torch.randn(batch, self.config.vocab_size, device=self.device)
        runner.sample(logits, [sampling] * batch)

    # -- post-capture -------------------------------------------------------------------
    def _start_post_capture(self, timings: dict[str, float]) -> StartupReport:
        # 2. Reserve: an upper bound from all free memory, no graph or activation reserve.
        free = measure_free(self.memory, self.group)
        probe = self._pool(PoolMode.POST_CAPTURE, self.args.page_size * 1024)
        bytes_per_token = probe.bytes_per_token
        probe.close()
        upper = max(int(free.min_bytes // bytes_per_token), self.args.page_size)
        if self.args.max_total_tokens:
            upper = min(upper, self.args.max_total_tokens + self.args.page_size)
        pool = self._pool(PoolMode.POST_CAPTURE, upper)
        # 3. Back the dummy page, 4. capture the decode graphs against the fixed addresses.
        runner = self._build_runner(pool, capacity_tokens=0)
        t0 = time.perf_counter()
        graph_bytes = self._capture(runner)
        timings["capture_s"] = time.perf_counter() - t0
        # 5. Measure: the activation peak of the largest eager step, then free memory.
        peak = measure_peak_bytes(self.device, lambda: self._largest_eager_step(runner))
        headroom = peak + self.args.headroom_margin_mib * MIB if self.device.type == "cuda" else 0
        measured = time.perf_counter()
        free = measure_free(self.memory, self.group)
        # 6. Size and 7. commit (with retry), then resize the allocators.
        measure_ms = (time.perf_counter() - measured) * 1e3
        result = size_post_capture(pool, free, headroom, self.args.max_total_tokens, self.group)
        resized = time.perf_counter()
        resize_slot_allocator(runner.allocator, pool, result.max_total_num_tokens)
        timings["sizing_measure_ms"] = measure_ms
        timings["sizing_commit_ms"] = result.took_ms
        timings["sizing_resize_ms"] = (time.perf_counter() - resized) * 1e3
        self._check_usable(runner)
        max_running = self._recap(runner, result.max_total_num_tokens)
        sizing_ms = (time.perf_counter() - measured) * 1e3
        self.runner, self.pool = runner, pool
        free_after = self.memory.mem_get_info()[0]
        self._log(
            "Post-capture KV sizing: max_total_num_tokens=%d, committed=%.2f GiB, headroom=%.2f GiB, "
            "free after=%.2f GiB, took=%.1f ms%s",
            result.max_total_num_tokens,
            result.committed_bytes / GIB,
            headroom / GIB,
            free_after / GIB,
            sizing_ms,
            self._per_rank_text(free.per_rank_bytes),
        )
        self._graph_bytes, self._activation_peak, self._headroom = graph_bytes, peak, headroom
        return StartupReport(
            SizingMode.POST_CAPTURE,
            result.max_total_num_tokens,
            max_running,
            ledger=None,  # type: ignore[arg-type]
            sizing_ms=sizing_ms,
            retries=result.retries,
            per_rank_free_bytes=free.per_rank_bytes,
        )

    @staticmethod
    def _per_rank_text(per_rank: tuple[int, ...]) -> str:
        if len(per_rank) <= 1:
            return ""
        return ", free per rank=[" + ", ".join(f"{value / GIB:.2f}" for value in per_rank) + "] GiB"

    def _check_usable(self, runner: ModelRunner) -> None:
        """A pool whose allocator can hand out nothing (e.g. a sliding-window sub-pool rounded down
        to 0 pages) would refuse every request: say so at start-up instead."""
        usable = runner.allocator.capacity_tokens
        if usable < 2 * self.args.page_size:  # one page for a prompt, one for its first new token
            raise SizingError(
                f"the KV cache holds {usable} usable tokens, less than two pages of {self.args.page_size}; "
                "raise --max-total-tokens (or --host-kv-gib on CPU), lower --page-size, or for a "
                "sliding-window model raise --swa-full-tokens-ratio"
            )

    def _recap(self, runner: ModelRunner, tokens: int) -> int:
        max_running = recap_running_requests(self.args.max_running_requests, tokens, self.args.page_size)
        if max_running < self.args.max_running_requests:
            runner.req_to_token_pool.cap_requests(max_running)
        return max_running

    # -- static modes -------------------------------------------------------------------
    def _start_static(self, timings: dict[str, float]) -> StartupReport:
        """Profiled / static-fraction: size KV before capture, as classic engines do."""
        pages = max(2, self.args.chunked_prefill_size // self.args.page_size + 1)
        probe = self._pool(PoolMode.STATIC, pages * self.args.page_size)
        peak = self._profile_peak(probe)
        bytes_per_token = probe.bytes_per_token
        probe.close()
        settle(self.device)
        measured = time.perf_counter()
        free, total = self.memory.mem_get_info()
        used = total - free
        if self.mode is SizingMode.PROFILED:
            budget = profiled_kv_budget_bytes(
                total_bytes=total,
                used_bytes=used,
                activation_peak_bytes=peak,
                gpu_memory_utilization=self.args.gpu_memory_utilization,
            )
        else:
            budget = static_fraction_budget(
                total_bytes=total,
                used_bytes=used,
                chunked_prefill_tokens=self.args.chunked_prefill_size,
                max_graph_batch=max(self._graph_batch_sizes(), default=0),
                mem_fraction_static=self.args.mem_fraction_static,
            ).kv_budget_bytes
        tokens = (
            int(budget // bytes_per_token) // self.args.page_size * self.args.page_size - self.args.page_size
        )
        if self.args.max_total_tokens:
            tokens = min(tokens, self.args.max_total_tokens // self.args.page_size * self.args.page_size)
        tokens = agree_min(tokens, self.group)  # tp: every rank the same count
        if tokens <= 0:
            raise SizingError(
                f"--kv-sizing {self.mode} leaves no memory for the KV cache ({budget / GIB:.2f} GiB budget); "
                "raise --gpu-memory-utilization / --mem-fraction-static or use post-capture sizing"
            )
        pool = self._pool(PoolMode.STATIC, tokens)
        runner = self._build_runner(pool, capacity_tokens=pool.capacity_tokens)
        sizing_ms = (time.perf_counter() - measured) * 1e3
        t0 = time.perf_counter()
        graph_bytes = self._capture(runner)
        timings["capture_s"] = time.perf_counter() - t0
        self._check_usable(runner)
        max_running = self._recap(runner, pool.capacity_tokens)
        self.runner, self.pool = runner, pool
        self._log(
            "KV sizing (%s): max_total_num_tokens=%d, committed=%.2f GiB, budget=%.2f GiB, took=%.1f ms",
            self.mode,
            pool.capacity_tokens,
            pool.committed_bytes / GIB,
            budget / GIB,
            sizing_ms,
        )
        self._graph_bytes, self._activation_peak, self._headroom = graph_bytes, peak, 0
        return StartupReport(
            self.mode,
            pool.capacity_tokens,
            max_running,
            ledger=None,  # type: ignore[arg-type]
            sizing_ms=sizing_ms,
        )

    def _profile_peak(self, pool: KVPool) -> int:
        runner = self._build_runner(pool, capacity_tokens=0)
        return measure_peak_bytes(self.device, lambda: self._largest_eager_step(runner))

    # -- report -------------------------------------------------------------------------
    def _ledger(self, *, baseline_free: int, total: int, report: StartupReport) -> MemoryLedger:
        weights = sum(p.numel() * p.element_size() for p in self.loaded.model.parameters())
        kv_committed = self.pool.committed_bytes
        if self.device.type == "cuda":
            free, total = self._device_mem_info()
            baseline = total - baseline_free
            torch_reserved = torch.cuda.memory_reserved(self.device)
            kv_in_torch = kv_committed if isinstance(self.memory, PlainMemory) else 0
            graphs_and_buffers = torch_reserved - weights - kv_in_torch
        else:
            free, total = self.memory.mem_get_info()
            baseline, graphs_and_buffers = 0, 0
        return MemoryLedger(
            device=str(
                torch.cuda.get_device_name(self.device)
                if self.device.type == "cuda"
                else "cpu (host backend)"
            ),
            total_bytes=total,
            free_bytes=free,
            baseline_bytes=baseline,
            weights_bytes=weights,
            graphs_and_buffers_bytes=graphs_and_buffers,
            graph_executables_bytes=self._graph_driver_bytes,
            kv_committed_bytes=kv_committed,
            kv_reserved_va_bytes=self.pool.arena.reserved_bytes,
            activation_peak_bytes=self._activation_peak,
            headroom_bytes=self._headroom,
            weights_in_device_memory=self.device.type == "cuda",
        )

    # -- shutdown -----------------------------------------------------------------------
    def close(self) -> None:
        """Release graphs, pool views and the arena, in that order; idempotent."""
        runner = getattr(self, "runner", None)
        if runner is None:
            return
        runner.cuda_graphs = None
        runner.kv_pool = None
        runner.allocator = None  # an SWA allocator holds a view of the pool's slot map
        self.runner = None  # type: ignore[assignment]
        del runner
        settle(self.device)
        try:
            self.pool.close()
            if not self.pool._owns_arena:
                self.pool.arena.close()
        except RuntimeError as exc:  # a caller still holds a KV tensor: the arena goes when it does
            logger.warning("KV arena not released yet: %s", exc)
