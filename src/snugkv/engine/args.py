"""The engine's flags as one frozen value: defaults per device, and the checks that name the flag."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from snugkv.attention.registry import attention_backend_names
from snugkv.memory.layout import KV_DTYPES, KVLayout, parse_kv_dtype
from snugkv.memory.vmm import MIB
from snugkv.models.loader import DTYPE_NAMES, LOAD_FORMATS
from snugkv.models.quantization import QUANTIZATION_CHOICES
from snugkv.sizing.measure import GUEST_ROOM_BYTES
from snugkv.sizing.modes import SizingMode
from snugkv.speculative.config import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    DEFAULT_SPECULATIVE_MAX_BATCH_SIZE,
    SpeculativeConfig,
)

# A pressure move's spill: half of issue 36's target of 50 ms for a shrink of up to 10 GiB (the
# resize itself takes the other half); at ~50 GB/s over PCIe 5 that is ~1.2 GB of pages.
DEFAULT_PRESSURE_SPILL_MS = 25.0


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Everything start-up needs. `None` means: pick the default for the device."""

    model: str | None = None
    load_format: str = "auto"
    revision: str | None = None  # with a Hugging Face Hub id: the branch, tag or commit
    dtype: str | None = None
    quantization: str | None = None  # "fp8": quantize a float checkpoint at load (FP8 ones load as FP8)
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
    # device memory every sizing leaves free to the driver for another process to start (its CUDA
    # context and first allocations); None: `GUEST_ROOM_BYTES` on a GPU, 0 on the host backend
    guest_room_mib: int | None = None
    host_kv_gib: float | None = (
        None  # CPU: RAM the KV cache may take (default: 25% of free RAM, at most 1 GiB)
    )
    # pinned host memory for the prefix cache's second tier: what leaves the device is kept there;
    # None: a default on a GPU that leaves the host room (snugkv.engine.host_tier), off on CPU; 0: off
    kv_host_tier_gib: float | None = None
    swa_full_tokens_ratio: float = 0.8
    tp_size: int = 1  # tensor-parallel ranks; > 1 runs one engine per rank (snugkv.distributed.launch)
    max_device_memory_gib: float | None = None  # cap on the engine's device memory, kept on every resize
    kv_chunk_mib: float | None = (
        None  # largest KV extension (a shrink drops whole ones); None: 512 MiB over all buffers
    )
    disable_overlap_schedule: bool = False  # the scheduler reads each step's tokens before the next
    kv_reserve_gib: float | None = None  # KV address space to reserve (default: free memory at start)
    no_kv_pressure: bool = False  # keep the KV cache's size when free memory falls below the headroom
    # a pressure shrink writes to the host tier only what this many ms of copies carry (at the
    # bandwidth measured at start-up) and drops the rest of what it evicts
    kv_pressure_spill_ms: float = DEFAULT_PRESSURE_SPILL_MS
    queue_timeout_s: float = 30.0  # how long a request waits for KV memory the cache does not hold now
    speculative: str | None = None  # "ngram" or "suffix": model-free speculative decoding; None: off
    num_speculative_tokens: int | None = None  # draft tokens per row and step (default 4 when on)
    speculative_max_batch_size: int = DEFAULT_SPECULATIVE_MAX_BATCH_SIZE  # more rows: no speculation

    def speculative_config(self) -> SpeculativeConfig | None:
        """The speculation the flags ask for (None: off); `InvalidEngineArgs` naming the flag."""
        if self.speculative is None:
            if self.num_speculative_tokens is not None:
                raise InvalidEngineArgs(
                    "--num-speculative-tokens needs --speculative ngram or --speculative suffix"
                )
            return None
        try:
            return SpeculativeConfig(
                method=self.speculative,
                num_tokens=DEFAULT_NUM_SPECULATIVE_TOKENS
                if self.num_speculative_tokens is None
                else self.num_speculative_tokens,
                max_batch_size=self.speculative_max_batch_size,
            )
        except ValueError as exc:
            raise InvalidEngineArgs(str(exc)) from None

    def validate(self) -> None:
        """Refuse values no engine can run with, naming the flag (before `resolved` fills defaults)."""
        for flag, value, choices in (
            ("--load-format", self.load_format, LOAD_FORMATS),
            ("--kv-layout", self.kv_layout, tuple(KVLayout)),
            ("--attention-backend", self.attention_backend, attention_backend_names()),
            ("--kv-sizing", self.kv_sizing, tuple(SizingMode)),
            ("--quantization", self.quantization, QUANTIZATION_CHOICES),
        ):
            if value is not None and value not in choices:
                raise InvalidEngineArgs(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise InvalidEngineArgs(
                f"--dtype must be one of auto, float32, bfloat16, float16, got {self.dtype!r}"
            )
        if self.kv_dtype is not None:
            try:
                parse_kv_dtype(self.kv_dtype)
            except ValueError:
                raise InvalidEngineArgs(
                    f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}"
                ) from None
        # A context of 0 tokens holds no prompt; left out, it is the model's own.
        for flag, count in (
            ("--context-length", self.context_length),
            ("--chunked-prefill-size", self.chunked_prefill_size),
        ):
            if count is not None and count < 1:
                raise InvalidEngineArgs(
                    f"{flag} must be a positive number of tokens, got {count} (or leave it out)"
                )
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise InvalidEngineArgs(
                f"--cuda-graph-max-bs must be at least 1, got {self.cuda_graph_max_bs} "
                "(--disable-cuda-graph turns the graphs off)"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidEngineArgs(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise InvalidEngineArgs(
                f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}"
            )
        if self.headroom_margin_mib < 0:
            raise InvalidEngineArgs(
                f"--headroom-margin-mib must be 0 or more, got {self.headroom_margin_mib}"
            )
        if self.guest_room_mib is not None and self.guest_room_mib < 0:
            raise InvalidEngineArgs(f"--guest-room-mib must be 0 or more, got {self.guest_room_mib}")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise InvalidEngineArgs(
                f"--swa-full-tokens-ratio must be in (0, 1], got {self.swa_full_tokens_ratio}"
            )
        if self.queue_timeout_s <= 0:
            raise InvalidEngineArgs(
                f"--queue-timeout must be a positive number of seconds, got {self.queue_timeout_s}"
            )
        if self.kv_reserve_gib is not None and self.kv_reserve_gib <= 0:
            raise InvalidEngineArgs(f"--kv-reserve-gib must be positive, got {self.kv_reserve_gib}")
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
        if not self.kv_pressure_spill_ms >= 0:  # NaN too
            raise InvalidEngineArgs(
                f"--kv-pressure-spill-ms must be 0 (drop what a pressure move evicts) or positive, "
                f"got {self.kv_pressure_spill_ms}"
            )
        if self.kv_host_tier_gib is not None and self.kv_host_tier_gib < 0:
            raise InvalidEngineArgs(
                f"--kv-host-tier-gib must be 0 (no host tier) or positive, got {self.kv_host_tier_gib}"
            )
        if self.prefill_graph_max_tokens is not None and self.prefill_graph_max_tokens < 0:
            raise InvalidEngineArgs(
                f"--prefill-graph-max-tokens must be 0 (off) or positive, got {self.prefill_graph_max_tokens}"
            )
        if self.max_device_memory_gib is not None and self.max_device_memory_gib <= 0:
            raise InvalidEngineArgs(f"--max-device-memory must be positive, got {self.max_device_memory_gib}")
        if self.kv_chunk_mib is not None and self.kv_chunk_mib <= 0:
            raise InvalidEngineArgs(f"--kv-chunk-mib must be positive, got {self.kv_chunk_mib}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise InvalidEngineArgs(
                f"--max-running-requests must be at least 1, got {self.max_running_requests}"
            )
        if self.tp_size < 1:
            raise InvalidEngineArgs(f"--tp must be >= 1, got {self.tp_size}")
        self.speculative_config()

    def ignored_flag_warnings(self, given: set[str]) -> list[str]:
        """One line per field in `given` (set by the caller, not by default) whose flag does nothing
        under the sizing mode these args ask for."""
        warnings = []
        # Without VMM an unset --kv-sizing falls back to profiled, where the fraction does apply.
        if "gpu_memory_utilization" in given and self.kv_sizing not in (None, "profiled"):
            warnings.append(
                f"--gpu-memory-utilization {self.gpu_memory_utilization} is ignored: it applies only with "
                f"--kv-sizing profiled, not {self.kv_sizing} (--max-device-memory caps the engine in every mode)"
            )
        elif "gpu_memory_utilization" in given and self.kv_sizing is None:
            warnings.append(
                f"--gpu-memory-utilization {self.gpu_memory_utilization} is ignored under post-capture sizing "
                "(the default: the KV cache takes what is free after capture); it applies with --kv-sizing "
                "profiled, or where the engine falls back to it without VMM (--max-device-memory caps the engine)"
            )
        if "mem_fraction_static" in given and self.kv_sizing != "static-fraction":
            warnings.append(
                f"--mem-fraction-static {self.mem_fraction_static} is ignored: it applies only with "
                "--kv-sizing static-fraction"
            )
        return warnings

    def resolved(self, device: torch.device) -> EngineArgs:
        """The defaults of `device` filled in; refuses what cannot run there (`InvalidEngineArgs`)."""
        gpu = device.type == "cuda"
        if self.attention_backend == "triton" and not gpu:
            raise InvalidEngineArgs(
                f"--attention-backend triton runs on a CUDA GPU, not on {device.type}; "
                "use --attention-backend torch (the default there)"
            )
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
            guest_room_mib=self.guest_room_mib
            if self.guest_room_mib is not None
            else (GUEST_ROOM_BYTES // MIB if gpu else 0),
        )


class InvalidEngineArgs(ValueError):
    """An engine flag out of range; the message names the flag and what to pass."""
