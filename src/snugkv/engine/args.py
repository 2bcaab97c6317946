"""The engine's flags as one frozen value of groups (snugkv.engine.config), built from flat flags.

`EngineArgs.of(model=..., page_size=16)` takes the flags as keywords, `_` for `-` (the command line,
`LLM(**options)` and tests all build it so), fills the settings whose default depends on the device
(a left-out flag is None) and builds each group, which checks its own fields. Code inside the engine
reads the groups: `args.cache.page_size`, `args.scheduler.max_running_requests`. An `EngineArgs`
is final: nothing later fills or checks it again, and it crosses to an engine process as it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from snugkv.engine.config import (
    CacheConfig,
    InvalidEngineArgs,
    LoadConfig,
    MemoryConfig,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
    flag_of,
)
from snugkv.memory.vmm import MIB
from snugkv.models.loader import resolve_device
from snugkv.sizing.measure import GUEST_ROOM_BYTES
from snugkv.speculative.config import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    DEFAULT_SPECULATIVE_MAX_BATCH_SIZE,
    SpeculativeConfig,
)

__all__ = ["SETTINGS", "EngineArgs", "InvalidEngineArgs", "Setting", "flag_of"]

GROUPS: dict[str, type] = {
    "load": LoadConfig,
    "parallel": ParallelConfig,
    "cache": CacheConfig,
    "memory": MemoryConfig,
    "scheduler": SchedulerConfig,
    "runner": RunnerConfig,
}
# Left out (None), these take the device's default (`_device_defaults`).
DEVICE_DEFAULTED = frozenset(
    {
        "page_size",
        "attention_backend",
        "max_running_requests",
        "chunked_prefill_size",
        "cuda_graph_max_bs",
        "prefill_graph_max_tokens",
        "guest_room_mib",
    }
)


@dataclass(frozen=True, slots=True)
class Setting:
    """One flat keyword of `EngineArgs.of`: `group` holds it; `type` is what a caller may pass."""

    name: str
    group: str
    type: str


def _settings() -> dict[str, Setting]:
    settings = {}
    for group, config in GROUPS.items():
        for field in dataclasses.fields(config):
            kind = str(field.type) + (" | None" if field.name in DEVICE_DEFAULTED else "")
            settings[field.name] = Setting(field.name, group, kind)
    # speculation's flags build a `SpeculativeConfig`, or None when `speculative` is left out
    for name, kind in (
        ("speculative", "str | None"),
        ("draft_model", "str | None"),
        ("num_speculative_tokens", "int | None"),
        ("speculative_max_batch_size", "int"),
    ):
        settings[name] = Setting(name, "speculative", kind)
    return settings


SETTINGS: dict[str, Setting] = _settings()


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Everything start-up needs, in groups; build it from flags with `EngineArgs.of(**flat)`."""

    load: LoadConfig
    parallel: ParallelConfig
    cache: CacheConfig
    memory: MemoryConfig
    scheduler: SchedulerConfig
    runner: RunnerConfig
    speculative: SpeculativeConfig | None = None  # None: off

    def __post_init__(self) -> None:
        """The checks that span two groups."""
        page = self.cache.page_size
        total = self.memory.max_total_tokens
        if total is not None and total < 2 * page:
            at = f" at --page-size {page}" if page > 1 else ""
            raise InvalidEngineArgs(
                f"--max-total-tokens {total} is below two KV pages ({2 * page} tokens{at}); raise it"
            )
        if self.runner.attention_backend == "triton" and self.device_type != "cuda":
            raise InvalidEngineArgs(
                f"--attention-backend triton runs on a CUDA GPU, not on {self.device_type}; "
                "use --attention-backend torch (the default there)"
            )

    @classmethod
    def of(cls, **flat: Any) -> EngineArgs:
        """The args of the flags `flat` (`SETTINGS` names them; None: left out), the device's
        defaults filled in; `InvalidEngineArgs` naming the first flag out of range."""
        unknown = sorted(set(flat) - set(SETTINGS))
        if unknown:
            raise TypeError(f"EngineArgs.of() got settings it does not know: {', '.join(unknown)}")
        given = {name: value for name, value in flat.items() if value is not None}
        gpu = resolve_device(given.get("device")).type == "cuda"
        values = {**_device_defaults(given, gpu), **given}
        if not gpu:
            values["disable_cuda_graph"] = True
        groups = {
            group: config(**{name: values[name] for name in _names(config) if name in values})
            for group, config in GROUPS.items()
        }
        return cls(**groups, speculative=_speculative(given))

    def with_settings(self, **flat: Any) -> EngineArgs:
        """These args with some flags changed (flat names, as `of` takes them), checked again; the
        device's defaults `of` filled in stay (change `device` through `of`)."""
        changes: dict[str, dict[str, Any]] = {}
        for name, value in flat.items():
            setting = SETTINGS.get(name)
            if setting is None or setting.group == "speculative":
                raise TypeError(f"with_settings() cannot change {name!r}")
            changes.setdefault(setting.group, {})[name] = value
        groups = {
            group: dataclasses.replace(getattr(self, group), **values) for group, values in changes.items()
        }
        return dataclasses.replace(self, **groups)

    @property
    def device_type(self) -> str:
        """ "cuda" or "cpu": where `--device` (None: a GPU if there is one) runs the engine."""
        return resolve_device(self.parallel.device).type

    def ignored_flag_warnings(self, given: set[str]) -> list[str]:
        """One line per field in `given` (set by the caller, not by default) whose flag does nothing
        under the sizing mode these args ask for."""
        memory, warnings = self.memory, []
        # Without VMM an unset --kv-sizing falls back to profiled, where the fraction does apply.
        if "gpu_memory_utilization" in given and memory.kv_sizing not in (None, "profiled"):
            warnings.append(
                f"--gpu-memory-utilization {memory.gpu_memory_utilization} is ignored: it applies only with "
                f"--kv-sizing profiled, not {memory.kv_sizing} (--max-device-memory caps the engine in every mode)"
            )
        elif "gpu_memory_utilization" in given and memory.kv_sizing is None:
            warnings.append(
                f"--gpu-memory-utilization {memory.gpu_memory_utilization} is ignored under post-capture sizing "
                "(the default: the KV cache takes what is free after capture); it applies with --kv-sizing "
                "profiled, or where the engine falls back to it without VMM (--max-device-memory caps the engine)"
            )
        if "mem_fraction_static" in given and memory.kv_sizing != "static-fraction":
            warnings.append(
                f"--mem-fraction-static {memory.mem_fraction_static} is ignored: it applies only with "
                "--kv-sizing static-fraction"
            )
        return warnings


def _names(config: type) -> list[str]:
    return [field.name for field in dataclasses.fields(config)]


def _device_defaults(given: dict[str, Any], gpu: bool) -> dict[str, Any]:
    """The defaults of the settings in `DEVICE_DEFAULTED`, on a GPU or on the host."""
    chunk = given.get("chunked_prefill_size", 8192 if gpu else 512)
    return {
        "page_size": 16 if gpu else 1,
        "attention_backend": "triton" if gpu else "torch",
        "max_running_requests": 256 if gpu else 16,
        "chunked_prefill_size": chunk,
        "cuda_graph_max_bs": 256,  # the CPU runs no graphs (`disable_cuda_graph`)
        "prefill_graph_max_tokens": chunk if gpu else 0,
        "guest_room_mib": GUEST_ROOM_BYTES // MIB if gpu else 0,
    }


def _speculative(given: dict[str, Any]) -> SpeculativeConfig | None:
    """The speculation the flags ask for (None: off); `InvalidEngineArgs` naming the flag."""
    method = given.get("speculative")
    if method is None:
        if "draft_model" in given:
            raise InvalidEngineArgs("--draft-model needs --speculative draft or eagle")
        if "num_speculative_tokens" in given:
            raise InvalidEngineArgs(
                "--num-speculative-tokens needs --speculative ngram, suffix, draft or eagle"
            )
        return None
    try:
        return SpeculativeConfig(
            method=method,
            num_tokens=given.get("num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS),
            max_batch_size=given.get("speculative_max_batch_size", DEFAULT_SPECULATIVE_MAX_BATCH_SIZE),
            draft_model=given.get("draft_model"),
        )
    except ValueError as exc:
        raise InvalidEngineArgs(str(exc)) from None
