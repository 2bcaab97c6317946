"""`snugkv bench pressure` on a CPU: a real default server (the embedded SmolLM2) on a simulated
shared device, and a separate process that takes its memory at once, step by step and at start-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from snugkv.cli import main

pytestmark = pytest.mark.slow


def test_every_scenario_serves_every_request_and_the_cache_shrinks_and_comes_back(tmp_path: Path) -> None:
    args = ["bench", "pressure", "--device", "cpu", "--long", "2", "--long-tokens", "160", "--short", "2"]
    args += ["--short-tokens", "16", "--output-tokens", "6", "--hold-s", "2", "--step-mib", "4"]
    args += ["--grow-gib", "0.0625", "--grow-hold-s", "2", "--leave-mib", "1", "--out", str(tmp_path)]
    assert main(args) == 0
    report = json.loads((tmp_path / "pressure.json").read_text())
    rows = {row["scenario"]: row for row in report["rows"]}
    assert list(rows) == ["all-but", "grow", "start"]
    for name, row in rows.items():
        assert row["complete"] > 0 and row["5xx"] == row["truncated"] == row["client-error"] == 0, row
        assert row["server_alive"] and row["taken_gib"] > 0, row
        if name != "start":  # the other process moved with streams under way
            assert row["in_flight_when_taken"] > 0, row
        if name == "grow":  # a step refused before the engine yields is tried again at the next tick
            assert row["taken_gib"] >= 0.0625 - 1e-3, row  # (how many were: a timing, not checked here)
        else:  # one allocation of what the driver said was free
            assert row["taken_failed_allocations"] == 0, row
        assert row["shrinks"] >= 1 and row["kv_tokens_min"] < row["kv_tokens_start"], (name, row)
        assert row["committed_gib_min"] < row["committed_gib_start"], row
        assert row["min_released_over_needed"] >= 0.9, row
        assert row["back_s"] is not None and row["kv_tokens_after"] >= 0.99 * row["kv_tokens_start"], row
    assert report["server_log_tracebacks"] == 0
