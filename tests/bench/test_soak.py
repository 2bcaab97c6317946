"""`snugkv bench soak` for half a minute on a CPU: a real server (the embedded SmolLM2) under every
kind of request, resized, put to sleep and woken, and sharing its simulated device with a process
that takes memory and gives it back; no 5xx, no leaked slot, and the report says so from the
server's own counters."""

from __future__ import annotations

import importlib.util
import json

import pytest

from snugkv.bench.soak_load import KINDS
from snugkv.bench.soak_report import leaked_slots
from snugkv.cli import main

# End to end (make test-fast leaves it out): a server process under load for 30 s.
pytestmark = pytest.mark.slow


def test_a_half_minute_soak_exercises_every_kind_and_leaks_nothing(tmp_path, capsys):
    report_path = tmp_path / "soak.json"
    args = ["bench", "soak", "--minutes", "0.5", "--control-every-s", "3", "--json", str(report_path)]
    assert main(args) == 0, capsys.readouterr().out[-4000:]
    report = json.loads(report_path.read_text())
    rows = {row["kind"]: row for row in report["rows"]}
    expected = set(KINDS) - ({"structured"} if importlib.util.find_spec("xgrammar") is None else set())
    for kind in expected:
        # every kind answered (or cut by its client) in the round before the timed load; how many
        # more the 30 s took depends on the machine's speed and load, so it is not asserted
        assert report["untimed_by_kind"][kind] in ("200", "client-cut"), (kind, report["untimed_by_kind"])
        row = rows.get(kind, {"5xx": 0, "client-error": 0})
        assert row["5xx"] == row["client-error"] == 0, row
    # the cutting kinds cut (their round before the timed load; a loaded machine may not run them
    # again in the 30 s: at load 2 on 2 cores each kind ran once in all)
    assert report["untimed_by_kind"]["disconnect"] == report["untimed_by_kind"]["abort"] == "client-cut"
    assert report["totals"]["5xx"] == 0 and report["failures"] == []
    assert (
        report["leaked_slots"]["leaked"] == 0
        and report["leaked_slots"]["detail"] == "free + cached == capacity"
    )
    assert report["resizes_ok"] >= 1 and report["sleep_wake_cycles"] >= 1
    assert report["hog_cycles"] >= 1 and max(report["hog_held_bytes"]) > 0  # the server made room
    assert report["kv_tokens"]["end"] == report["kv_tokens"]["start"]
    assert report["server_rss_bytes"]["start"] > 0 and report["server_rss_bytes"]["end"] > 0
    assert len(report["latency"]) == 3  # per 10 s under two minutes
    for window in report["latency"]:
        assert window["server_rss_mib"] > 0 and window["engine_rss_mib"] > 0, window
        # a request belongs to the window it started in: on a loaded machine (CI at 7274258: each
        # request took 7-10 s) every client can be mid-request through a whole window
        if window["answered"]:
            assert window["p50_ms"] <= window["p99_ms"], window
    assert sum(window["answered"] for window in report["latency"]) > 0


def test_a_slot_the_idle_check_or_get_kv_finds_held_is_a_leak():
    accounting = {"checked": True, "ok": True, "detail": "", "capacity_tokens": 100, "free_tokens": 90}
    idle_kv = {"used_tokens": 10, "cached_tokens": 10, "held_by_requests_tokens": 0}
    assert (
        leaked_slots({"slot_accounting_when_idle": {**accounting, "cached_tokens": 10}}, idle_kv)["leaked"]
        == 0
    )
    assert (
        leaked_slots({"slot_accounting_when_idle": {**accounting, "cached_tokens": 7}}, idle_kv)["leaked"]
        == 3
    )
    held_kv = {**idle_kv, "used_tokens": 14, "held_by_requests_tokens": 4}
    assert (
        leaked_slots({"slot_accounting_when_idle": {**accounting, "cached_tokens": 10}}, held_kv)["leaked"]
        == 4
    )
    failed = {**accounting, "cached_tokens": 10, "ok": False}
    assert leaked_slots({"slot_accounting_when_idle": failed}, idle_kv)["leaked"] == 1
    assert leaked_slots({"slot_accounting_when_idle": {"checked": False}}, idle_kv)["leaked"] >= 1
