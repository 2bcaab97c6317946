"""The engine's settings in groups, each a frozen value that checks its own fields once, when built.

`EngineArgs` (snugkv.engine.args) holds one of each: what to load (`LoadConfig`), where it runs
(`ParallelConfig`), the KV cache's shape and its prefix cache (`CacheConfig`), how the KV cache is
sized and resized (`MemoryConfig`), what the scheduler admits (`SchedulerConfig`) and how the model
runs (`RunnerConfig`); speculation is `snugkv.speculative.config.SpeculativeConfig`. A field is
named as its command-line flag with `_` for `-` (`page_size` is `--page-size`; `FLAGS` lists the
others), so a refusal names the flag and `EngineArgs.of(**flat)` routes a flag to its group by name.

The values here are final: a setting whose default depends on the device was filled in by
`EngineArgs.of` before the group was built. Nothing here reads the device or loads anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from snugkv.attention.registry import attention_backend_names
from snugkv.memory.layout import KV_DTYPES, KVLayout, parse_kv_dtype
from snugkv.models.loader import DTYPE_NAMES, LOAD_FORMATS
from snugkv.models.quantization import QUANTIZATION_CHOICES
from snugkv.sizing.modes import SizingMode

# fields whose flag is not their name with - for _
FLAGS = {
    "tp_size": "--tp",
    "max_device_memory_gib": "--max-device-memory",
    "queue_timeout_s": "--queue-timeout",
    "enable_prefix_cache": "--disable-prefix-cache",
}


def flag_of(field_name: str) -> str:
    """The command-line flag of a setting."""
    return FLAGS.get(field_name, "--" + field_name.replace("_", "-"))


class InvalidEngineArgs(ValueError):
    """An engine flag out of range; the message names the flag and what to pass."""


def _one_of(flag: str, value: str | None, choices: tuple[str, ...]) -> None:
    if value is not None and value not in choices:
        raise InvalidEngineArgs(f"{flag} must be one of {', '.join(choices)}, got {value!r}")


def _positive_or_none(flag: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise InvalidEngineArgs(f"{flag} must be positive, got {value}")


# A pressure move's spill: half of issue 36's target of 50 ms for a shrink of up to 10 GiB (the
# resize itself takes the other half); at ~50 GB/s over PCIe 5 that is ~1.2 GB of pages.
DEFAULT_PRESSURE_SPILL_MS = 25.0


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """What to load: `model` (a directory, .gguf, config.json or Hub id; None: the embedded default),
    how to read it, and the context it serves (None: the model's own)."""

    model: str | None = None
    load_format: str = "auto"
    revision: str | None = None  # with a Hugging Face Hub id: the branch, tag or commit
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on a GPU
    quantization: str | None = None  # "fp8": quantize a float checkpoint at load (FP8 ones load as FP8)
    weights_seed: int = 0  # random (dummy) weights only
    context_length: int | None = None

    def __post_init__(self) -> None:
        _one_of("--load-format", self.load_format, LOAD_FORMATS)
        _one_of("--quantization", self.quantization, QUANTIZATION_CHOICES)
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise InvalidEngineArgs(
                f"--dtype must be one of auto, float32, bfloat16, float16, got {self.dtype!r}"
            )
        # A context of 0 tokens holds no prompt; left out, it is the model's own.
        _positive_tokens("--context-length", self.context_length)


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Where the engine runs: `device` as given (None or "auto": a GPU if there is one) and its
    tensor-parallel ranks (> 1 runs one engine per rank: snugkv.distributed.launch)."""

    device: str | None = None
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise InvalidEngineArgs(f"--tp must be >= 1, got {self.tp_size}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The KV cache's shape and what it keeps between requests."""

    page_size: int  # tokens per KV page
    kv_dtype: str | None = None  # None: the model's dtype
    kv_layout: str = "nhd"
    swa_full_tokens_ratio: float = 0.8  # sliding-window layers' KV tokens per full-attention token
    enable_prefix_cache: bool = True  # finished requests' KV stays for the next prompt that shares it
    # pinned host memory for the prefix cache's second tier: what leaves the device is kept there;
    # None: a default on a GPU that leaves the host room (snugkv.engine.host_tier), off on CPU; 0: off
    kv_host_tier_gib: float | None = None

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise InvalidEngineArgs(f"--page-size must be at least 1, got {self.page_size}")
        _one_of("--kv-layout", self.kv_layout, tuple(KVLayout))
        if self.kv_dtype is not None:
            try:
                parse_kv_dtype(self.kv_dtype)
            except ValueError:
                raise InvalidEngineArgs(
                    f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}"
                ) from None
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise InvalidEngineArgs(
                f"--swa-full-tokens-ratio must be in (0, 1], got {self.swa_full_tokens_ratio}"
            )
        if self.kv_host_tier_gib is not None and self.kv_host_tier_gib < 0:
            raise InvalidEngineArgs(
                f"--kv-host-tier-gib must be 0 (no host tier) or positive, got {self.kv_host_tier_gib}"
            )


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    """How the KV cache is sized at start and resized while it runs, and the memory it may take."""

    # device memory every sizing leaves free to the driver for another process to start (its CUDA
    # context and first allocations); `GUEST_ROOM_BYTES` on a GPU unless given, 0 on the host backend
    guest_room_mib: int
    kv_sizing: str | None = None  # None: post-capture, profiled where VMM is unavailable
    max_total_tokens: int | None = None  # cap on KV cache tokens
    gpu_memory_utilization: float = 0.9  # --kv-sizing profiled only
    mem_fraction_static: float | None = None  # --kv-sizing static-fraction only
    headroom_margin_mib: int = 256  # stated safety margin on top of the measured activation peak
    host_kv_gib: float | None = (
        None  # CPU: RAM the KV cache may take (default: 25% of free RAM, at most 1 GiB)
    )
    max_device_memory_gib: float | None = None  # cap on the engine's device memory, kept on every resize
    kv_chunk_mib: float | None = (
        None  # largest KV extension (a shrink drops whole ones); None: 512 MiB in all
    )
    kv_reserve_gib: float | None = None  # KV address space to reserve (default: free memory at start)
    no_kv_pressure: bool = False  # keep the KV cache's size when free memory falls below the headroom
    # what a pressure move may spend copying evicted prefixes to the host tier (the rest is dropped)
    kv_pressure_spill_ms: float = DEFAULT_PRESSURE_SPILL_MS

    def __post_init__(self) -> None:
        _one_of("--kv-sizing", self.kv_sizing, tuple(SizingMode))
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
        if self.guest_room_mib < 0:
            raise InvalidEngineArgs(f"--guest-room-mib must be 0 or more, got {self.guest_room_mib}")
        _positive_or_none("--kv-reserve-gib", self.kv_reserve_gib)
        _positive_or_none("--host-kv-gib", self.host_kv_gib)
        _positive_or_none("--max-device-memory", self.max_device_memory_gib)
        _positive_or_none("--kv-chunk-mib", self.kv_chunk_mib)
        if not self.kv_pressure_spill_ms >= 0:  # NaN too
            raise InvalidEngineArgs(
                f"--kv-pressure-spill-ms must be 0 (drop what a pressure move evicts) or positive, "
                f"got {self.kv_pressure_spill_ms}"
            )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """What the scheduler admits per step, and how long a request may wait for memory."""

    max_running_requests: int
    chunked_prefill_size: int  # prefill tokens per step
    disable_overlap_schedule: bool = False  # the scheduler reads each step's tokens before the next
    disable_mixed_steps: bool = False  # a prefill step does not take the running requests' decode rows along
    queue_timeout_s: float = 30.0  # how long a request waits for KV memory the cache does not hold now

    def __post_init__(self) -> None:
        _positive_tokens("--chunked-prefill-size", self.chunked_prefill_size)
        if self.max_running_requests < 1:
            raise InvalidEngineArgs(
                f"--max-running-requests must be at least 1, got {self.max_running_requests}"
            )
        if self.queue_timeout_s <= 0:
            raise InvalidEngineArgs(
                f"--queue-timeout must be a positive number of seconds, got {self.queue_timeout_s}"
            )


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """How the model runs: the attention kernels and the CUDA graphs (never on CPU)."""

    attention_backend: str
    cuda_graph_max_bs: int  # largest decode graph batch
    prefill_graph_max_tokens: int  # piecewise graphs (everything but attention) up to this; 0: none
    disable_cuda_graph: bool = False

    def __post_init__(self) -> None:
        _one_of("--attention-backend", self.attention_backend, attention_backend_names())
        if self.cuda_graph_max_bs < 1:
            raise InvalidEngineArgs(
                f"--cuda-graph-max-bs must be at least 1, got {self.cuda_graph_max_bs} "
                "(--disable-cuda-graph turns the graphs off)"
            )
        if self.prefill_graph_max_tokens < 0:
            raise InvalidEngineArgs(
                f"--prefill-graph-max-tokens must be 0 (off) or positive, got {self.prefill_graph_max_tokens}"
            )

    @property
    def decode_graph_max_bs(self) -> int:
        """The largest decode graph's batch; 0: no decode graphs."""
        return 0 if self.disable_cuda_graph else self.cuda_graph_max_bs

    @property
    def prefill_graph_tokens(self) -> int:
        """The largest piecewise graph's token count; 0: none."""
        return 0 if self.disable_cuda_graph else self.prefill_graph_max_tokens


def _positive_tokens(flag: str, count: int | None) -> None:
    if count is not None and count < 1:
        raise InvalidEngineArgs(f"{flag} must be a positive number of tokens, got {count} (or leave it out)")
