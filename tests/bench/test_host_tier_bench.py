"""`snugkv bench host-tier` on a CPU, end to end: two real servers of the embedded SmolLM2 (tier off,
then on) on a simulated shared device, tiny multi-turn chat and a pressure row with a separate
process taking memory (`--workloads chat,pressure`: the fitting load's row is the chat row's path
at another shape, `fitting_shape`, tested on its own). Every request succeeds, and with the tier on
the chat and the pressure rows are served partly from the host tier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from snugkv.bench.chat_load import ChatShape, fitting_shape
from snugkv.cli import main


def test_the_fitting_shape_holds_its_share_of_the_device_kv_in_whole_sessions() -> None:
    chat = ChatShape(sessions=40, turns=3, user_tokens=20, output_tokens=4)  # 72 tokens a session
    fits = fitting_shape(chat, kv_tokens=1000, share=0.5)
    assert fits == ChatShape(6, 3, 20, 4) and fits.sessions * fits.session_tokens <= 500
    assert fitting_shape(chat, kv_tokens=100, share=0.5).sessions == 1  # never none


@pytest.mark.slow
def test_the_tier_on_serves_chat_and_pressure_rows_from_the_host_and_nothing_fails(tmp_path: Path) -> None:
    args = ["bench", "host-tier", "--device", "cpu", "--sessions", "6", "--turns", "3"]
    args += ["--output-tokens", "4", "--concurrency", "3", "--device-kv-tokens", "512"]
    args += ["--working-set", "1.5", "--host-tier-gib", "0.05", "--out", str(tmp_path), "--sample-scheduler"]
    args += ["--workloads", "chat,pressure"]
    assert main(args) == 0
    report = json.loads((tmp_path / "host_tier.json").read_text())
    assert report["benchmark"] == "host_tier" and {"date", "commit", "device"} <= set(report["environment"])
    rows = {(row["workload"], row["tier"]): row for row in report["rows"]}
    assert set(rows) == {(w, t) for w in ("chat", "pressure") for t in ("off", "on")}
    for row in rows.values():
        assert row["failed"] == 0 and row["server_alive"] and row["requests"] > 0, row
        assert row["output_tok_per_s"] > 0 and row["median_ttft_ms"] is not None, row
    assert rows[("chat", "off")]["host_hit_rate"] is None
    for tier in ("off", "on"):  # the chat rows say where the server's device time went
        chat = rows[("chat", tier)]
        assert chat["steps"] > 0 and chat["prefill_busy_s"] > 0 and chat["decode_busy_s"] >= 0, chat
        assert chat["prefill_step_tokens"] >= chat["requests"], chat
    assert rows[("chat", "on")]["host_hit_rate"] > 0.1, rows[("chat", "on")]
    pressure = rows[("pressure", "on")]
    assert pressure["shrinks"] >= 1 and pressure["taken_gib"] > 0, pressure
    assert pressure["host_hit_rate"] > 0, pressure
    assert report["shapes"]["chat"]["sessions"] == 6
    assert report["bandwidth"]["tier_load_gb_per_s"] > 0
    assert report["server_log_tracebacks"] == 0
    for tier in ("off", "on"):  # where each server's scheduler thread spent its time
        assert "_turns" in (tmp_path / f"scheduler-tier-{tier}.txt").read_text()
