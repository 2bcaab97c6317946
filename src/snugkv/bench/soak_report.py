"""The soak's figures from what it saw: outcomes by kind, latency per window, leaked slots, RSS.

Pure functions of the outcomes and of the server's own answers (`GET /server_info`, `GET /kv`),
plus one read of /proc (or psutil where it is installed) for a process's resident memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from snugkv.bench.harness import percentile_ms
from snugkv.bench.soak_load import KINDS, OUTCOMES, Outcome

CONTROL_KINDS = ("resize", "sleep", "wake", "hog")


def outcome_rows(outcomes: Sequence[Outcome], controls: Sequence[Outcome]) -> list[dict[str, Any]]:
    """One row per request kind, then per control kind: the count of each outcome, p50/p99 of the 200s."""
    rows = []
    for group, kinds in (("request", KINDS), ("control", CONTROL_KINDS)):
        seen = outcomes if group == "request" else controls
        for kind in kinds:
            mine = [outcome for outcome in seen if outcome.kind == kind]
            answered = [outcome.latency_s for outcome in mine if outcome.outcome == "200"]
            row: dict[str, Any] = {"kind": kind, "group": group}
            row.update({name: sum(1 for outcome in mine if outcome.outcome == name) for name in OUTCOMES})
            row["p50_ms"] = percentile_ms(answered, 0.5)
            row["p99_ms"] = percentile_ms(answered, 0.99)
            rows.append(row)
    return rows


def latency_windows(
    outcomes: Sequence[Outcome], began_s: float, window_s: float, windows: int
) -> list[dict[str, Any]]:
    """Each of `windows` windows of `window_s` (a request belongs to the one it started in):
    requests, answered, p50/p99 of the answered."""
    by_window: list[list[Outcome]] = [[] for _ in range(windows)]
    for outcome in outcomes:
        index = int(max(outcome.started_s - began_s, 0.0) // window_s)
        by_window[min(index, windows - 1)].append(outcome)
    rows = []
    for index, mine in enumerate(by_window):
        answered = [outcome.latency_s for outcome in mine if outcome.outcome == "200"]
        rows.append(
            {
                "window_s": f"{index * window_s:g}-{(index + 1) * window_s:g}",
                "requests": len(mine),
                "answered": len(answered),
                "p50_ms": percentile_ms(answered, 0.5),
                "p99_ms": percentile_ms(answered, 0.99),
            }
        )
    return rows


def leaked_slots(info: dict[str, Any], kv: dict[str, Any]) -> dict[str, Any]:
    """KV slots neither free nor in the prefix cache, with nothing in flight (both must say 0).

    The server's own check (`slot_accounting_when_idle`, run by the scheduler once it goes idle):
    capacity - free - cached. `GET /kv` read after it: used - cached, and what requests still hold.
    A check that did not run counts as a leak: the soak cannot vouch for slots it could not see."""
    accounting = info.get("slot_accounting_when_idle") or {}
    kv_leak = int(kv["used_tokens"]) - int(kv["cached_tokens"])
    held = int(kv.get("held_by_requests_tokens", 0))
    if not accounting.get("checked"):
        return {
            "leaked": max(kv_leak, held, 1),
            "detail": "the server's idle slot check did not run",
            "kv": kv_leak,
        }
    accounted = accounting["capacity_tokens"] - accounting["free_tokens"] - accounting["cached_tokens"]
    leaked = max(accounted, kv_leak, held, 0 if accounting.get("ok") else 1)
    return {
        "leaked": leaked,
        "detail": accounting.get("detail", ""),
        "slot_accounting": accounted,
        "kv_used_minus_cached": kv_leak,
        "held_by_requests_tokens": held,
    }


def process_rss_bytes(pid: int) -> int | None:
    """Resident memory of process `pid` (psutil where installed, else /proc/PID/status), None if gone."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return int(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None
