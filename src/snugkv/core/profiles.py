"""A profile's report, and where its time went: a torch profiler trace (Chrome trace JSON, `.json` or `.json.gz`)
summed by kind of device kernel, the same way for any engine that writes one (snugkv's
`POST /stop_profile`, SGLang's and vLLM's `/stop_profile`), so that two engines' steps can be set
side by side (issue 33).

Device work is the trace's events of category `kernel`, `gpu_memcpy` and `gpu_memset`; a trace
without any (a CPU run) is summed over its `cpu_op` events instead, and says so (`device: false`):
those nest (`aten::linear` holds `aten::addmm`), so their sums pass the span; a smoke test of the
path, not a breakdown.
Each kernel name falls in one kind (`KINDS`, first match); what matches none is `other`.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_DIR_ENV = "SNUGKV_PROFILE_DIR"  # where traces go; the HTTP routes write nowhere else
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# kind: substrings of a lower-cased kernel name, first match wins (order matters: attention before
# GEMMs, as a split-KV attention kernel's name holds "splitk"; "decode" and "extend" name attention
# kernels here)
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("copy", ("memcpy", "memset")),
    ("kv-store", ("reshape_and_cache", "set_kv", "kv_store", "store_kv")),  # before "flash" in their names
    ("norm", ("rmsnorm", "layernorm", "rms_norm")),  # before "flash": flashinfer's norm kernels
    # SGLang's Triton attention kernels are `_fwd_kernel` (extend) and `_fwd_grouped_kernel_stage1/2`
    (
        "attention",
        ("attn", "attention", "flash", "decode", "extend", "fmha", "mla", "_fwd_kernel", "_fwd_grouped"),
    ),
    (
        "gemm",
        (
            "gemm",
            "gemv",
            "nvjet",
            "cutlass",
            "xmma",
            "cublas",
            "splitk",
            "matmul",
            "addmm",
            "aten::mm",
            "bmm",
            "linear",
        ),
    ),
    ("moe", ("moe", "expert", "topk_softmax", "align_block")),
    ("kv-store", ("store", "kv_cache", "scatter")),
    ("norm", ("norm", "rsqrt")),
    ("rope", ("rope", "rotary")),
    ("activation", ("silu", "gelu", "act_and_mul", "swiglu")),
    ("sampling", ("sample", "softmax", "argmax", "topk", "top_k", "top_p", "sort", "cumsum", "multinomial")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "reduce", "index", "cat", "fill", "copy")),
)


def default_profile_dir() -> Path:
    return Path(os.environ.get(PROFILE_DIR_ENV) or Path(tempfile.gettempdir()) / "snugkv-profile")


def kind_of(name: str, kinds: Sequence[tuple[str, Sequence[str]]], default: str = "other") -> str:
    """The first kind of `kinds` one of whose substrings the lower-cased `name` holds."""
    lowered = name.lower()
    return next((kind for kind, needles in kinds if any(needle in lowered for needle in needles)), default)


def kernel_kind(name: str) -> str:
    return kind_of(name, KINDS)


@dataclass(frozen=True, slots=True)
class TraceSummary:
    """Time by kind and the busiest kernels of one trace, in microseconds."""

    device: bool  # summed over device kernels (False: a trace without any, summed over CPU ops)
    total_us: float
    span_us: float  # from the first event's start to the last one's end
    kinds: dict[str, float]  # kind -> time
    top: list[dict[str, Any]] = field(default_factory=list)  # name, kind, us, calls; busiest first

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "total_us": round(self.total_us, 1),
            "span_us": round(self.span_us, 1),
            "busy_fraction": round(self.total_us / self.span_us, 4) if self.span_us else None,
            "kinds": {
                kind: round(us, 1) for kind, us in sorted(self.kinds.items(), key=lambda item: -item[1])
            },
            "top": self.top,
        }


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """The events of a Chrome trace file (a JSON object with `traceEvents`, or a bare list)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        data = json.load(handle)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [event for event in events if isinstance(event, dict)]


def summarize_events(events: list[dict[str, Any]], top: int = 15) -> TraceSummary:
    """Sum complete events (`ph` "X") with a duration by kind; device kernels when there are any."""
    timed = [
        event for event in events if event.get("ph") == "X" and isinstance(event.get("dur"), int | float)
    ]
    device = [event for event in timed if event.get("cat") in DEVICE_CATEGORIES]
    chosen = device or [event for event in timed if event.get("cat") == "cpu_op"]
    kinds: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in chosen:
        name, duration = str(event.get("name", "")), float(event["dur"])
        kinds[kernel_kind(name)] += duration
        by_name[name][0] += duration
        by_name[name][1] += 1
    starts = [float(event["ts"]) for event in chosen if "ts" in event]
    ends = [float(event["ts"]) + float(event["dur"]) for event in chosen if "ts" in event]
    busiest = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return TraceSummary(
        device=bool(device),
        total_us=sum(kinds.values()),
        span_us=(max(ends) - min(starts)) if starts else 0.0,
        kinds=dict(kinds),
        top=[
            {"name": name[:160], "kind": kernel_kind(name), "us": round(us, 1), "calls": int(calls)}
            for name, (us, calls) in busiest
        ],
    )


def summarize_trace(path: str | Path, top: int = 15) -> TraceSummary:
    return summarize_events(read_trace(path), top)


def newest_trace(directory: str | Path) -> Path | None:
    """The most recent trace file under `directory` (what an engine wrote at its stop_profile)."""
    found = [
        path
        for pattern in ("*.json", "*.json.gz", "*.pt.trace.json.gz")
        for path in Path(directory).rglob(pattern)
        if path.is_file()
    ]
    return max(found, key=lambda path: path.stat().st_mtime, default=None)


class ProfileError(RuntimeError):
    """A profile that cannot start or stop now (already running, not running, a bad directory);
    `status` is the HTTP status the server answers with."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[Any, ...]:  # crosses from the engine process with its status
        return (type(self), (str(self), self.status))


@dataclass(frozen=True, slots=True)
class ProfileReport:
    trace_path: str
    steps: int
    seconds: float
    summary: TraceSummary

    def to_dict(self) -> dict[str, Any]:
        return {
            "trace_path": self.trace_path,
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
            "summary": self.summary.to_dict(),
        }
