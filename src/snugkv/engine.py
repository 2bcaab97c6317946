"""The engine's start-up: load, reserve, capture, measure, size, commit, report.

`Engine.__init__` is the whole start-up pipeline in order; read it top to bottom. In
post-capture mode the KV pool is virtual addresses only until after the decode graphs are
captured; then free memory is measured (MIN over ranks), the activation peak of the largest
eager step is measured, and exactly what is left is backed. The static modes size the pool
before capture, as classic engines do, for comparison and as the fallback without VMM.
From `Engine.ready` on, the runner serves like a statically sized one.

At run time a post-capture engine can change its KV cache without capturing a graph again:
`resize_kv` grows or shrinks it (the scheduler's elastic module first makes a shrink fit by
evicting cache entries and, only if needed, retracting requests; snugkv.runner.kv_resize moves
the live pages), and `--max-device-memory` caps the whole engine at start-up and on every resize.

Tensor parallelism (`tp_size > 1`): every rank runs this same pipeline on its own GPU with its
slice of the model and a KV pool of its own KV heads; `tp` (snugkv.distributed) comes from the
launcher, its CPU group is the sizing group, and only rank 0 logs the sizing line and ledger.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from snugkv.attention.registry import attention_backend_names
from snugkv.core.forward import BatchRow
from snugkv.core.sampling import SamplingParams
from snugkv.distributed.group import TensorParallel, use_tensor_parallel
from snugkv.memory.arena import DEFAULT_CHUNK_BYTES
from snugkv.memory.kv_pool import KVPool, KVPoolSpec, PoolMode
from snugkv.memory.layout import KVLayout
from snugkv.memory.moves import KvMoves
from snugkv.memory.vmm import GIB, MIB, CommitError, VirtualMemory
from snugkv.memory.vmm_factory import create_vmm
from snugkv.memory.vmm_host import HostVmm, available_ram_bytes
from snugkv.memory.vmm_plain import PlainMemory
from snugkv.models.loader import LOAD_FORMATS, LoadedModel, fill_weights, load_model, resolve_device
from snugkv.runner import kv_resize
from snugkv.runner.cuda_graph import default_cuda_graph_batch_sizes
from snugkv.runner.kv_cache import make_kv_pool
from snugkv.runner.model_runner import ModelRunner
from snugkv.runner.piecewise_graphs import default_token_buckets
from snugkv.sizing.ledger import MemoryLedger, measure_ledger
from snugkv.sizing.measure import (
    agree_min,
    device_memory,
    engine_device_bytes,
    measure_capture,
    measure_free,
    measure_peak_bytes,
    settle,
)
from snugkv.sizing.modes import (
    SizingMode,
    profiled_kv_budget_bytes,
    resolve_mode,
    static_fraction_budget,
    static_kv_tokens,
)
from snugkv.sizing.post_capture import (
    SizingError,
    finalize_with_retry,
    recap_running_requests,
    size_post_capture,
    tokens_for_budget,
)
from snugkv.sizing.resize import KvResize, KvResizeError, ResizeLimits, cap_tokens, check_free_gib

logger = logging.getLogger(__name__)

SLEEP_TAGS = frozenset({"weights", "kv_cache"})  # what sleep can release (vLLM's and SGLang's names)
KEPT_TAGS = frozenset({"cuda_graph"})  # SGLang's tag for the graphs: accepted, they stay (no re-capture)


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
    prefill_graph_max_tokens: int | None = (
        None  # piecewise graphs (everything but attention) up to this many tokens
    )
    disable_cuda_graph: bool = False
    gpu_memory_utilization: float = 0.9
    mem_fraction_static: float | None = None
    headroom_margin_mib: int = 256  # stated safety margin on top of the measured activation peak
    host_kv_gib: float | None = (
        None  # CPU: RAM the KV cache may take (default: 25% of free RAM, at most 1 GiB)
    )
    swa_full_tokens_ratio: float = 0.8
    tp_size: int = 1  # tensor-parallel ranks; > 1 runs one engine per rank (snugkv.distributed.launch)
    max_device_memory_gib: float | None = None  # cap on the engine's device memory, kept on every resize
    kv_chunk_mib: int = DEFAULT_CHUNK_BYTES // MIB  # largest KV extension: what a shrink drops whole
    disable_overlap_schedule: bool = False  # the scheduler reads each step's tokens before the next

    def validate(self) -> None:
        """Refuse values no engine can run with, naming the flag (before `resolved` fills defaults)."""
        for flag, value, choices in (
            ("--load-format", self.load_format, LOAD_FORMATS),
            ("--kv-layout", self.kv_layout, tuple(KVLayout)),
            ("--attention-backend", self.attention_backend, attention_backend_names()),
            ("--kv-sizing", self.kv_sizing, tuple(SizingMode)),
        ):
            if value is not None and value not in choices:
                raise InvalidEngineArgs(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
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
        if self.prefill_graph_max_tokens is not None and self.prefill_graph_max_tokens < 0:
            raise InvalidEngineArgs(
                f"--prefill-graph-max-tokens must be 0 (off) or positive, got {self.prefill_graph_max_tokens}"
            )
        if self.max_device_memory_gib is not None and self.max_device_memory_gib <= 0:
            raise InvalidEngineArgs(f"--max-device-memory must be positive, got {self.max_device_memory_gib}")
        if self.kv_chunk_mib < 1:
            raise InvalidEngineArgs(f"--kv-chunk-mib must be at least 1, got {self.kv_chunk_mib}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise InvalidEngineArgs(
                f"--max-running-requests must be at least 1, got {self.max_running_requests}"
            )
        if self.tp_size < 1:
            raise InvalidEngineArgs(f"--tp must be >= 1, got {self.tp_size}")

    def resolved(self, device: torch.device) -> EngineArgs:
        gpu = device.type == "cuda"
        chunk = self.chunked_prefill_size or (8192 if gpu else 512)
        prefill_graphs = self.prefill_graph_max_tokens
        if prefill_graphs is None:
            prefill_graphs = chunk if gpu else 0
        return replace(
            self,
            page_size=self.page_size or (16 if gpu else 1),
            attention_backend=self.attention_backend or ("triton" if gpu else "torch"),
            max_running_requests=self.max_running_requests or (256 if gpu else 16),
            chunked_prefill_size=chunk,
            cuda_graph_max_bs=self.cuda_graph_max_bs or (256 if gpu else 0),
            prefill_graph_max_tokens=prefill_graphs,
            disable_cuda_graph=self.disable_cuda_graph or not gpu,
        )


class InvalidEngineArgs(ValueError):
    """An engine flag out of range; the message names the flag and what to pass."""


@dataclass(frozen=True, slots=True)
class SizedKV:
    """What a sizing mode leaves behind: the runner over its sized pool, and the figures the
    report and the ledger show."""

    runner: ModelRunner
    max_total_num_tokens: int
    max_running_requests: int
    sizing_ms: float
    activation_peak_bytes: int
    headroom_bytes: int
    graph_driver_bytes: int
    retries: int = 0
    per_rank_free_bytes: tuple[int, ...] = ()
    timings: dict[str, float] = field(default_factory=dict)  # keys carry their unit

    @property
    def pool(self) -> KVPool:
        return self.runner.kv_pool


@dataclass(frozen=True, slots=True)
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
    runner: ModelRunner | None
    pool: KVPool

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
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.zeros(1, device=self.device)  # CUDA context first, so the baseline includes it

        # 1. Load weights (baseline before, so the ledger can tell them apart). Post-capture places
        # them in virtual memory too, so sleep can release them without breaking a graph.
        self.mode = resolve_mode(args.kv_sizing, self.device)
        baseline_free, _ = device_memory(self.device)
        with use_tensor_parallel(tp):  # the model is built sharded for this rank
            self.loaded: LoadedModel = load_model(
                args.model,
                load_format=args.load_format,
                dtype=args.dtype,
                device=self.device,
                seed=args.weights_seed,
                max_position=args.context_length,
                weights_memory=self._weights_memory(),
            )
        if tp.enabled and not self.loaded.model.supports_tensor_parallel:
            raise ValueError(
                f"{self.loaded.config.architecture} does not support --tp yet; run it with --tp 1"
            )
        self.config = self.loaded.config
        self.kv_dtype = args.kv_dtype or self.loaded.dtype
        self.context_length = args.context_length or self.config.max_position_embeddings
        load_s = time.perf_counter() - started

        self.memory = self._memory_backend()
        self.baseline_free_bytes = baseline_free
        self.kv_events: deque[dict[str, Any]] = deque(maxlen=32)  # resizes, sleeps, wakes (newest last)
        self.kv_event_count = 0  # every one so far (the history keeps the last 32)
        self._graph_driver_bytes = 0  # set once the graphs are captured
        self.sleeping_tags: frozenset[str] = frozenset()  # what sleep released: "weights", "kv_cache"
        self.sleep_level = 0  # of the last sleep: 1 keeps the weights on the host, 2 drops them
        sized = self._start_post_capture() if self.mode is SizingMode.POST_CAPTURE else self._start_static()
        self.runner, self.pool = sized.runner, sized.pool
        self.headroom_bytes = sized.headroom_bytes
        self._activation_peak_bytes = sized.activation_peak_bytes
        ledger = self._measure_ledger()
        self.report = StartupReport(
            self.mode,
            sized.max_total_num_tokens,
            sized.max_running_requests,
            ledger=ledger,
            sizing_ms=sized.sizing_ms,
            retries=sized.retries,
            per_rank_free_bytes=sized.per_rank_free_bytes,
            timings={"load_s": load_s, **sized.timings, "total_s": time.perf_counter() - started},
        )
        self._log("%s", ledger.table())

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
        )

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

    def _weights_memory(self) -> VirtualMemory | None:
        """Virtual memory for the weights where the KV cache has it too (post-capture); on CPU an
        mmap backend of its own, so the weights never count against the KV budget."""
        if self.mode is not SizingMode.POST_CAPTURE:
            return None
        return HostVmm() if self.device.type == "cpu" else create_vmm(self.device)

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
            chunk_bytes=self.args.kv_chunk_mib * MIB,
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

    def _capture(self, runner: ModelRunner) -> tuple[int, float]:
        """Capture the decode graphs and the piecewise prefill graphs; returns the driver memory
        they took outside torch's allocator (the ledger's own item) and the seconds it took."""
        sizes, buckets = self._graph_batch_sizes(), self._prefill_graph_buckets()
        if not sizes and not buckets:
            return 0, 0.0

        def capture() -> None:
            if sizes:
                runner.capture_cuda_graphs(sizes)
            if buckets:
                runner.capture_piecewise_graphs(buckets)

        started = time.perf_counter()
        taken = measure_capture(self.device, capture)
        return taken.driver_bytes, time.perf_counter() - started

    def _largest_eager_step(self, runner: ModelRunner) -> None:
        """The biggest eager work the engine will run: the largest prefill chunk, decode beyond the
        graphs, and the sampler over the largest batch with top-k and top-p, on the dummy slot only.

        Row 0 of the table is the padding row (all zeros), so every token reads and writes
        slot 0: this runs before any KV beyond the dummy page is backed.
        """
        sampling = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
        chunk = min(self._chunked_prefill_size, self.context_length)
        logits = runner.forward(
            [BatchRow(0, 0, [0] * chunk)], torch.zeros(chunk, dtype=torch.int64, device=self.device)
        )
        runner.sample(logits, [sampling])
        sizes = self._graph_batch_sizes()
        batch = self._max_running_requests
        if not sizes or batch > max(sizes):
            rows = [BatchRow(0, 1, [0])] * batch
            logits = runner.forward(rows, torch.zeros(batch, dtype=torch.int64, device=self.device))
        else:  # graph decode: its logits live in the graph pool; sampling them runs eagerly
            logits = torch.randn(batch, self.config.vocab_size, device=self.device)
        runner.sample(logits, [sampling] * batch)

    # -- post-capture -------------------------------------------------------------------
    def _start_post_capture(self) -> SizedKV:
        page = self._page_size
        # 2. Reserve: an upper bound from all free memory, no graph or activation reserve.
        free = measure_free(self.memory, self.group)
        probe = self._pool(PoolMode.POST_CAPTURE, page * 1024)
        bytes_per_token = probe.bytes_per_token
        probe.close()
        reserved_tokens = max(int(free.min_bytes // bytes_per_token), page)
        if self.args.max_total_tokens:
            reserved_tokens = min(reserved_tokens, self.args.max_total_tokens + page)
        pool = self._pool(PoolMode.POST_CAPTURE, reserved_tokens)
        # 3. Back the dummy page, 4. capture the decode graphs against the fixed addresses.
        runner = self._build_runner(pool)
        graph_driver_bytes, capture_s = self._capture(runner)
        self._graph_driver_bytes = graph_driver_bytes
        # 5. Measure: the activation peak of the largest eager step, then free memory.
        peak = measure_peak_bytes(self.device, lambda: self._largest_eager_step(runner))
        headroom = peak + self.args.headroom_margin_mib * MIB if self.device.type == "cuda" else 0
        measured = time.perf_counter()
        free = measure_free(self.memory, self.group)
        measure_ms = (time.perf_counter() - measured) * 1e3
        # 6. Size and 7. commit (with retry), then resize the allocators.
        kv_cap = self._kv_cap_bytes(pool, headroom)
        if kv_cap is not None and pool.max_tokens_within(kv_cap) < 2 * page:
            raise SizingError(self._cap_too_small(pool, headroom))
        result = size_post_capture(
            pool, free, headroom, self.args.max_total_tokens, self.group, kv_cap_bytes=kv_cap
        )
        resized = time.perf_counter()
        runner.allocator.resize(result.max_total_num_tokens)
        resize_ms = (time.perf_counter() - resized) * 1e3
        self._check_usable(runner)
        max_running = self._recap(runner, result.max_total_num_tokens)
        sizing_ms = (time.perf_counter() - measured) * 1e3
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
        return SizedKV(
            runner,
            result.max_total_num_tokens,
            max_running,
            sizing_ms=sizing_ms,
            activation_peak_bytes=peak,
            headroom_bytes=headroom,
            graph_driver_bytes=graph_driver_bytes,
            retries=result.retries,
            per_rank_free_bytes=free.per_rank_bytes,
            timings={
                "capture_s": capture_s,
                "sizing_measure_ms": measure_ms,
                "sizing_commit_ms": result.took_ms,
                "sizing_resize_ms": resize_ms,
            },
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
        if usable < 2 * self._page_size:  # one page for a prompt, one for its first new token
            raise SizingError(
                f"the KV cache holds {usable} usable tokens, less than two pages of {self._page_size}; "
                "raise --max-total-tokens (or --host-kv-gib on CPU), lower --page-size, or for a "
                "sliding-window model raise --swa-full-tokens-ratio"
            )

    def _recap(self, runner: ModelRunner, tokens: int) -> int:
        """`max_running_requests` for a pool of `tokens` (back up to the flag's value when it grew)."""
        max_running = recap_running_requests(self._max_running_requests, tokens, self._page_size)
        runner.req_to_token_pool.cap_requests(max_running)
        return max_running

    def _engine_device_bytes(self, pool: KVPool | None) -> int:
        """What `--max-device-memory` counts: the engine's own device memory (weights, graphs,
        buffers, KV), not the CUDA context nor other processes."""
        outside_torch = self._graph_driver_bytes
        if pool is not None and not isinstance(self.memory, PlainMemory):
            outside_torch += pool.committed_bytes
        if self.loaded.weights is not None:
            outside_torch += self.loaded.weights.committed_bytes
        return engine_device_bytes(self.memory, outside_torch)

    def _kv_cap_bytes(self, pool: KVPool, headroom_bytes: int) -> int | None:
        """What `--max-device-memory` leaves the KV cache: the cap less everything else the engine
        holds now and the activation headroom (None without a cap)."""
        if self.args.max_device_memory_gib is None:
            return None
        others = self._engine_device_bytes(pool) - pool.committed_bytes
        return int(self.args.max_device_memory_gib * GIB) - others - headroom_bytes

    def _cap_too_small(self, pool: KVPool, headroom_bytes: int) -> str:
        others = self._engine_device_bytes(pool) - pool.committed_bytes
        need = others + headroom_bytes + pool.bytes_for_tokens(2 * self._page_size)
        return (
            f"--max-device-memory {self.args.max_device_memory_gib:g} GiB leaves no room for the KV cache: "
            f"the engine already holds {others / GIB:.2f} GiB (weights, graphs, buffers) and keeps "
            f"{headroom_bytes / GIB:.2f} GiB of activation headroom; raise it to at least {need / GIB:.2f} GiB"
        )

    # -- static modes -------------------------------------------------------------------
    def _start_static(self) -> SizedKV:
        """Profiled / static-fraction: size KV before capture, as classic engines do."""
        page = self._page_size
        pages = max(2, self._chunked_prefill_size // page + 1)
        probe = self._pool(PoolMode.STATIC, pages * page)
        peak = self._profile_peak(probe)
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
        graph_driver_bytes, capture_s = self._capture(runner)
        self._graph_driver_bytes = graph_driver_bytes
        self._check_usable(runner)
        max_running = self._recap(runner, pool.committed_tokens)
        self._log(
            "KV sizing (%s): max_total_num_tokens=%d, committed=%.2f GiB, budget=%.2f GiB, took=%.1f ms",
            self.mode,
            pool.committed_tokens,
            pool.committed_bytes / GIB,
            budget / GIB,
            sizing_ms,
        )
        return SizedKV(
            runner,
            pool.committed_tokens,
            max_running,
            sizing_ms=sizing_ms,
            activation_peak_bytes=peak,
            headroom_bytes=0,
            graph_driver_bytes=graph_driver_bytes,
            timings={"capture_s": capture_s},
        )

    def _profile_peak(self, pool: KVPool) -> int:
        runner = self._build_runner(pool)
        return measure_peak_bytes(self.device, lambda: self._largest_eager_step(runner))

    # -- run-time resizing ------------------------------------------------------------------
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
        self.kv_events.append(change.to_dict())
        self.kv_event_count += 1
        self._log("%s", change.log_line())

    def kv_info(self) -> dict[str, Any]:
        """The KV cache now and what a resize would need (rank 0's view; no collective)."""
        pool = self.pool
        allocator = self.runner.allocator if self.runner is not None else None
        capacity = allocator.capacity_tokens if allocator is not None else 0
        available = allocator.available_tokens if allocator is not None else 0
        limits = self.kv_limits()
        free = self.memory.mem_get_info()[0]
        kv_cap = self._kv_cap_bytes(pool, self.headroom_bytes)
        fits_now = tokens_for_budget(pool, free, self.headroom_bytes, self.args.max_total_tokens, kv_cap)
        return {
            "max_total_num_tokens": pool.committed_tokens,
            "capacity_tokens": capacity,
            "used_tokens": capacity - available,
            "available_tokens": available,
            "usage": (capacity - available) / capacity if capacity else 0.0,
            "page_size": self._page_size,
            "committed_bytes": pool.committed_bytes,
            "reserved_bytes": pool.reserved_bytes,
            "reserved_tokens": pool.reserved_tokens,
            "bytes_per_token": pool.bytes_per_token,
            "chunk_bytes": pool.arena.chunk_bytes,
            "granularity_bytes": pool.arena.vmm.granularity_bytes,
            "min_tokens": limits.min_tokens,
            "max_tokens": limits.max_tokens,
            "max_tokens_bytes": pool.bytes_for_tokens(limits.max_tokens),
            "max_total_tokens": self.args.max_total_tokens,
            "max_device_memory_gib": self.args.max_device_memory_gib,
            "cap_tokens": limits.cap_tokens,
            "device_free_bytes": free,
            "headroom_bytes": self.headroom_bytes,
            "tokens_fitting_free_memory": fits_now,
            "max_running_requests": self.report.max_running_requests,
            "resizable": self.mode is SizingMode.POST_CAPTURE and not isinstance(self.memory, PlainMemory),
            "sleeping_tags": sorted(self.sleeping_tags),
            "events": list(self.kv_events),
        }

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
    def _check_tags(tags: Collection[str] | None) -> frozenset[str]:
        """The tags to act on (none given: all); `cuda_graph` is accepted and left alone."""
        if not tags:
            return SLEEP_TAGS
        given = frozenset(tags)
        unknown = sorted(given - SLEEP_TAGS - KEPT_TAGS)
        if unknown:
            names = ", ".join(sorted(SLEEP_TAGS | KEPT_TAGS))
            raise KvResizeError(f"unknown tag(s) {', '.join(unknown)}; tags are {names}", param="tags")
        return given & SLEEP_TAGS

    def sleep(self, level: int = 1, tags: Collection[str] | None = None) -> KvResize:
        """Release the KV cache and/or the weights (`tags`, default both); every KV slot must be free
        when the KV cache goes (the scheduler's elastic module retracts first). Level 1 copies the
        weights to host memory, level 2 drops them (wake reloads them from the model files).
        Graphs are kept: weights and KV come back at the same addresses."""
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
        """Take back what sleep released (`tags`, default all). The weights return at their
        addresses (copied back, or loaded again after level 2); the KV cache is sized again from
        free memory measured now (MIN over ranks, less the headroom, under the caps), not the old
        number, and committed at its old addresses, so the captured graphs run as they are."""
        chosen = self._check_tags(tags) & self.sleeping_tags
        if "kv_cache" in chosen and "weights" in self.sleeping_tags - chosen:
            raise KvResizeError(
                "wake the weights before the KV cache (the KV cache is sized from what they leave free): "
                "pass tags=weights first, or both",
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
        tokens, max_running = self.pool.committed_tokens, self.report.max_running_requests
        if "kv_cache" in chosen:
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
        self.pool.ensure_prefix()
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

    # -- shutdown -----------------------------------------------------------------------
    def close(self) -> None:
        """Release graphs, pool views and the arena, in that order; idempotent."""
        runner = self.runner
        if runner is None:
            return
        runner.close()
        self.runner = None
        settle(self.device)
        try:
            self.pool.close()
            if not self.pool.owns_arena:
                self.pool.arena.close()
        except RuntimeError as exc:  # a caller still holds a KV tensor: the arena goes when it does
            logger.warning("KV arena not released yet: %s", exc)
