"""What every benchmark shares: the clock, the floors, the percentiles, the record of what a run was
measured on, and the printed table with its raw JSON beside it.

- Timing: `time_cuda` (median of CUDA-event timings of single calls), `graph_seconds` (the same for
  calls captured in a CUDA graph: steps of a millisecond and more) and `graph_seconds_per_call`
  (back-to-back replays between one pair of events: ops of a few microseconds, where the launch of
  each replay would otherwise be timed too). `copy_bandwidth_bytes_per_s` and `DENSE_BF16_FLOPS`
  are the two floors the GPU benchmarks divide by.
- `percentile_ms`, `latency_columns`: the p50/p99 columns of every load generator;
  `client_limits`: the connection pool every HTTP load generator opens.
- `environment` (date, commit, Python, torch, device) and its torch-free part `provenance`.
- `emit` prints a benchmark's table and writes OUT/NAME.json (`benchmark`, `environment`, `rows`,
  then the benchmark's own keys) and OUT/NAME.md; `save` writes any other raw JSON (and its table).

It never measures an engine itself and never decides what a benchmark's rows hold.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from snugkv.memory.vmm import GIB

DENSE_BF16_FLOPS = 790e12  # H100/H200 dense bf16 peak: the compute floor of prefill and extend
GRAPH_WARM_CALLS = 3  # eager calls before a capture: Triton compiles and autotunes, the allocator warms


# -- the record of a run ------------------------------------------------------------------------
def cuda_missing(what: str, hint: str = "") -> bool:
    """True, after one `error:` line on stderr, when there is no CUDA GPU for `what` to run on."""
    if torch.cuda.is_available():
        return False
    print(f"error: {what} needs a CUDA GPU; torch {torch.__version__} sees none here{hint}", file=sys.stderr)
    return True


def provenance() -> dict[str, str]:
    """When and from what the numbers came: date, commit, Python (no torch, no CUDA context)."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "commit": commit(),
        "python": platform.python_version(),
    }


def environment() -> dict[str, str]:
    """What the numbers were measured on: `provenance` with torch's version and the device."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {**provenance(), "torch": torch.__version__, "device": device}


def commit() -> str:
    """The commit measured: $SNUGKV_COMMIT where set (a copied tree's git metadata can be stale),
    else git's short name of HEAD."""
    named = os.environ.get("SNUGKV_COMMIT", "")
    if named:
        return named
    try:
        found = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        ).stdout.strip()
    except OSError:
        found = ""
    return found or "unknown"


# -- tables and raw JSON ------------------------------------------------------------------------
def format_table(rows: Sequence[Mapping[str, object]]) -> str:
    """A markdown table with the union of the rows' keys as columns (nested values stay in the JSON)."""
    if not rows:
        return "(no rows)"
    columns = [
        key
        for key in dict.fromkeys(key for row in rows for key in row)
        if not any(isinstance(row.get(key), (dict, list)) for row in rows)
    ]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [
            f"{row.get(column, ''):.3f}" if isinstance(row.get(column), float) else str(row.get(column, ""))
            for column in columns
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def title(name: str, env: Mapping[str, object]) -> str:
    """The heading of a table: the benchmark, the device, torch, the date and the commit."""
    device = env.get("device") or env.get("gpu")
    return f"## {name} — {device}, torch {env.get('torch')}, {env['date']}, commit {env['commit']}"


def save(
    json_path: Path, payload: dict[str, Any], table_rows: Sequence[Mapping[str, object]] | None = None
) -> None:
    """The raw JSON at `json_path` and, given rows, their table beside it (`.md`), titled from the
    payload's `benchmark` and `environment` where it has them."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(payload, indent=2))
    if table_rows is None:
        return
    table = format_table(table_rows)
    if "environment" in payload and "benchmark" in payload:
        table = title(payload["benchmark"], payload["environment"]) + "\n\n" + table
    json_path.with_suffix(".md").write_text(table + "\n")


def emit(
    name: str, rows: list[dict[str, Any]], out_dir: str | None, extra: dict[str, Any] | None = None
) -> None:
    """Print the table under its heading; with `out_dir`, write OUT/NAME.json and OUT/NAME.md."""
    env = environment()
    print(title(name, env))
    print(format_table(rows), flush=True)
    if out_dir:
        payload = {"benchmark": name, "environment": env, "rows": rows, **(extra or {})}
        save(Path(out_dir) / f"{name}.json", payload, rows)


# -- latency ------------------------------------------------------------------------------------
# A client drops a connection idle this long, before the server can close it: servers close idle
# connections after 5 s (uvicorn's default, SGLang and vLLM keep it), and a client whose own expiry
# is also 5 s (httpx's default) may send a request down a connection the server is closing, which
# then fails with an empty ReadError (bench peers at e96c0b0: 1 of 256 requests to SGLang).
CLIENT_KEEPALIVE_S = 2.0


def client_limits(connections: int) -> Any:
    """httpx.Limits for a load generator of `connections` concurrent streams (httpx imported here:
    the GPU benchmarks run where no HTTP client is installed)."""
    import httpx

    return httpx.Limits(
        max_connections=connections,
        max_keepalive_connections=connections,
        keepalive_expiry=CLIENT_KEEPALIVE_S,
    )


def percentile_ms(seconds: Sequence[float], fraction: float) -> float | None:
    """The `fraction` percentile of `seconds` (nearest rank, no interpolation) in ms; None when empty."""
    if not seconds:
        return None
    ordered = sorted(seconds)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] * 1e3


def latency_columns(ttft_s: Sequence[float], tpot_s: Sequence[float]) -> dict[str, float | None]:
    """Time to first token and time per output token, p50 and p99, as a load generator's columns."""
    return {
        "ttft_p50_ms": percentile_ms(ttft_s, 0.5),
        "ttft_p99_ms": percentile_ms(ttft_s, 0.99),
        "tpot_p50_ms": percentile_ms(tpot_s, 0.5),
        "tpot_p99_ms": percentile_ms(tpot_s, 0.99),
    }


# -- the GPU clock and its floors ---------------------------------------------------------------
def time_cuda(fn: Callable[..., object], iterations: int = 30, warmup: int = 5) -> float:
    """Median seconds of `fn()` measured with CUDA events, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def cuda_graph_of(fn: Callable[..., object], calls: int = 1) -> torch.cuda.CUDAGraph:
    """`fn` captured `calls` times in one CUDA graph, after `GRAPH_WARM_CALLS` calls on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(GRAPH_WARM_CALLS):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graph_seconds(fn: Callable[..., object], calls: int = 1, iterations: int = 30, warmup: int = 5) -> float:
    """Seconds per call of `fn` captured `calls` times in one CUDA graph: the median replay
    (`time_cuda`) over `calls`."""
    graph = cuda_graph_of(fn, calls)
    seconds = time_cuda(graph.replay, iterations=iterations, warmup=warmup) / calls
    del graph
    return seconds


def graph_seconds_per_call(fn: Callable[..., object], reps: int, iters: int) -> float:
    """Seconds per call of `fn` captured `reps` times in one CUDA graph, over `iters` replays run
    back to back between one pair of events (no launch gap between replays is timed)."""
    graph = cuda_graph_of(fn, reps)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return start.elapsed_time(end) / 1e3 / (iters * reps)


def copy_bandwidth_bytes_per_s(size_bytes: int = 4 * GIB) -> float:
    """Device-to-device copy: bytes read plus bytes written, per second (median of 20)."""
    source = torch.empty(size_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    target = torch.empty_like(source)
    return 2 * size_bytes / time_cuda(lambda: target.copy_(source), iterations=20, warmup=5)
