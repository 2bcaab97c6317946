"""The engine's building blocks, shared by every start-up phase: the loaded model, its memory
backend and the resolved flags; it makes KV pools and model runners, the KV sizing object over a
runner, and counts the engine's own device memory (the graphs' driver memory, the activation
peak, the ledger).

`EngineBlocks` holds what the phases measured (`graph_driver_bytes`, `activation_peak_bytes`,
`verify_peak_bytes`, `draft_peak_bytes`, and the host tier's `host_tier_staging_bytes`) so that
the ledger and `--max-device-memory` count them; it never decides the
KV cache's size (the post-capture and static phases do, snugkv.engine.post_capture_start and
static_start) nor captures a graph itself (snugkv.engine.capture).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from snugkv.core.reports import MemoryLedger
from snugkv.distributed.group import TensorParallel
from snugkv.engine.args import EngineArgs
from snugkv.engine.draft_model import draft_kv_shape, weights_bytes
from snugkv.engine.kv_sizing import KvCaps, KvSizing, StartGate
from snugkv.memory.kv_pool import KVPool, KVPoolSpec, MHAKVPool, PoolMode
from snugkv.memory.vmm import GIB, MIB, CommitError, VirtualMemory
from snugkv.memory.vmm_plain import PlainMemory
from snugkv.models.loader import LoadedModel
from snugkv.runner.cuda_graph import default_cuda_graph_batch_sizes
from snugkv.runner.kv_cache import make_kv_pool
from snugkv.runner.model_runner import ModelRunner
from snugkv.runner.piecewise_graphs import default_token_buckets
from snugkv.sizing.ledger import measure_ledger
from snugkv.sizing.measure import engine_device_bytes
from snugkv.sizing.modes import SizingMode
from snugkv.sizing.post_capture import SizingError


class EngineBlocks:
    """One rank's loaded model and memory backend, and what the start-up phases build from them.
    `log`: the engine's rank-0 info log (one sizing line per engine, not one per rank)."""

    def __init__(
        self,
        *,
        args: EngineArgs,
        mode: SizingMode,
        device: torch.device,
        tp: TensorParallel,
        group: dist.ProcessGroup | None,
        loaded: LoadedModel,
        draft: LoadedModel | None = None,
        kv_dtype: torch.dtype | str,  # a name (--kv-dtype) or the weights' dtype
        context_length: int,
        memory: VirtualMemory,
        baseline_free_bytes: int,
        baseline_reserved_bytes: int,
        start_gate: StartGate | None,
        log: Callable[..., None],
    ) -> None:
        self.args = args
        self.mode = mode
        self.device = device
        self.tp = tp
        self.group = group
        self.loaded = loaded
        self.draft = draft  # a separate draft model (--draft-model PATH): KV beside the model's
        self.config = loaded.config
        self.kv_dtype = kv_dtype
        self.context_length = context_length
        self.memory = memory
        self.baseline_free_bytes = baseline_free_bytes
        self.baseline_reserved_bytes = baseline_reserved_bytes
        self.start_gate = start_gate
        self.log = log
        self.graph_driver_bytes = 0  # set once the graphs are captured
        self.activation_peak_bytes = 0  # measured before the KV cache is sized
        self.verify_peak_bytes = 0  # speculation on: the largest verify step's, within the peak
        self.draft_peak_bytes = 0  # --speculative draft: the largest batch's draft steps', within the peak
        self.host_tier_staging_bytes = 0  # the host tier's copy staging on the device, once it is open

    # -- the flags the start-up phases read -----------------------------------------------
    @property
    def draft_model(self) -> str:
        """`--draft-model` under `--speculative draft`; "" otherwise."""
        speculative = self.args.speculative
        return speculative.draft_model or "" if speculative is not None else ""

    @property
    def page_size(self) -> int:
        return self.args.cache.page_size

    @property
    def max_running_requests(self) -> int:
        return self.args.scheduler.max_running_requests

    @property
    def chunked_prefill_size(self) -> int:
        return self.args.scheduler.chunked_prefill_size

    def graph_batch_sizes(self) -> list[int]:
        """The decode graphs' batches: up to the rows a decode step can have, at most the flag's. A
        verify step is a decode batch of a row per position (docs/SPECULATIVE.md, item 8): with
        speculation a step of up to `--speculative-max-batch-size` requests runs `k + 1` rows each."""
        largest = self.args.runner.decode_graph_max_bs
        if not largest:
            return []
        rows = self.max_running_requests
        speculative = self.args.speculative
        if speculative is not None:
            rows = max(rows, min(rows, speculative.max_batch_size) * (speculative.num_tokens + 1))
        return default_cuda_graph_batch_sizes(min(largest, rows))

    def draft_graph_batch_sizes(self) -> list[int]:
        """An EAGLE-3 head's draft-step graphs: up to the rows a speculating step drafts for (a
        speculating step has at most `--speculative-max-batch-size` requests), at most the flag's."""
        largest, speculative = self.args.runner.decode_graph_max_bs, self.args.speculative
        if not largest or speculative is None or speculative.method != "eagle":
            return []
        return default_cuda_graph_batch_sizes(
            min(largest, self.max_running_requests, speculative.max_batch_size)
        )

    def prefill_graph_buckets(self) -> list[int]:
        largest = self.args.runner.prefill_graph_tokens
        return default_token_buckets(min(largest, self.context_length)) if largest else []

    # -- pools, runners, the KV sizing object -------------------------------------------
    def pool(self, mode: PoolMode, reserved_tokens: int) -> KVPool:
        chunk_mib = self.args.memory.kv_chunk_mib
        spec = KVPoolSpec.of(
            dtype=self.kv_dtype,
            page_size=self.page_size,
            layout=self.args.cache.kv_layout,
            device=self.device,
            mode=mode,
            memory=self.memory,
            chunk_bytes=None if chunk_mib is None else round(chunk_mib * MIB),
        )
        return make_kv_pool(
            self.config,
            spec,
            reserved_tokens=reserved_tokens,
            swa_full_tokens_ratio=self.args.cache.swa_full_tokens_ratio,
            num_kv_heads=self.loaded.model.num_kv_heads_per_rank,  # tp: this rank's
            draft=None if self.draft is None else draft_kv_shape(self.draft),
        )

    def build_runner(self, pool: KVPool) -> ModelRunner:
        try:
            return ModelRunner.build(
                self.loaded.model,
                pool,
                max_requests=self.max_running_requests,
                max_context_len=self.context_length,
                attention_backend=self.args.runner.attention_backend,
                tp=self.tp,
                draft_model=None if self.draft is None else self.draft.model,
            )
        except CommitError as exc:
            raise SizingError(
                f"could not back even the KV cache's first page ({exc}); free some memory"
                + (" or raise --host-kv-gib" if self.device.type == "cpu" else "")
            ) from exc

    def kv_sizing(self, runner: ModelRunner, headroom_bytes: int) -> KvSizing:
        pool = runner.kv_pool
        post_capture = self.mode is SizingMode.POST_CAPTURE  # the static modes leave no room
        guest_room = self.args.memory.guest_room_mib * MIB if post_capture else 0
        return KvSizing(
            runner,
            mode=self.mode,
            memory=self.memory,
            group=self.group,
            caps=KvCaps(
                page_size=self.page_size,
                max_total_tokens=self.args.memory.max_total_tokens,
                max_device_memory_gib=self.args.memory.max_device_memory_gib,
                max_running_requests=self.max_running_requests,
            ),
            headroom_bytes=headroom_bytes,
            workspace_bytes=self.activation_peak_bytes,
            held_besides_kv=lambda: self.engine_device_bytes(pool) - pool.committed_bytes,
            guest_room_bytes=guest_room,
            device_type=self.device.type,
            start_gate=self.start_gate,
        )

    # -- the engine's own memory ---------------------------------------------------------
    def engine_device_bytes(self, pool: KVPool | None) -> int:
        """What `--max-device-memory` counts: the engine's own device memory (weights, graphs,
        buffers, KV), not the CUDA context nor other processes."""
        outside_torch = self.graph_driver_bytes
        if pool is not None and not isinstance(self.memory, PlainMemory):
            outside_torch += pool.committed_bytes
        for loaded in (self.loaded, self.draft):
            if loaded is not None and loaded.weights is not None:
                outside_torch += loaded.weights.committed_bytes
        return engine_device_bytes(self.memory, outside_torch, self.baseline_reserved_bytes)

    def measure_ledger(self, kv: KvSizing) -> MemoryLedger:
        return measure_ledger(
            self.device,
            self.memory,
            baseline_free_bytes=self.baseline_free_bytes,
            weights_bytes=weights_bytes(self.loaded) + weights_bytes(self.draft),
            kv_committed_bytes=kv.pool.committed_bytes,
            kv_reserved_va_bytes=kv.pool.arena.reserved_bytes,
            kv_in_torch_allocator=isinstance(self.memory, PlainMemory),
            weights_in_torch_allocator=self.loaded.weights is None,
            weights_resident=self.loaded.weights is None or self.loaded.weights.resident,
            graph_executables_bytes=self.graph_driver_bytes,
            activation_peak_bytes=self.activation_peak_bytes,
            verify_peak_bytes=self.verify_peak_bytes,
            draft_model=self.draft_model,
            draft_peak_bytes=self.draft_peak_bytes,
            draft_weights_bytes=weights_bytes(self.draft),
            draft_kv_bytes_per_token=kv.pool.draft_bytes_per_token if isinstance(kv.pool, MHAKVPool) else 0,
            headroom_bytes=kv.headroom_bytes,
            guest_room_bytes=kv.guest_room_bytes,
            host_tier_staging_bytes=self.host_tier_staging_bytes,
        )


def per_rank_text(per_rank: tuple[int, ...]) -> str:
    """The sizing line's tail under tp: the free memory each rank measured."""
    if len(per_rank) <= 1:
        return ""
    return ", free per rank=[" + ", ".join(f"{value / GIB:.2f}" for value in per_rank) + "] GiB"
