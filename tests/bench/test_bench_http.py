"""`snugkv bench http` on a CPU with the stub device: the same load in process, through the async
engine and through a real server process and client (the engine in the server's process, and in
a process of its own), every token counted on every path."""

from __future__ import annotations

import json

import pytest

from snugkv.bench.serving import workload
from snugkv.cli import main

# End to end (make test-fast leaves it out): the HTTP benchmark against a server process.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tokenizer", [None, "default"], ids=["ids", "text"])
def test_bench_http_runs_the_load_five_ways_on_a_stub_device_after_a_first_pass(tmp_path, capsys, tokenizer):
    args = ["bench", "http", "--stub-step-ms", "1", "--requests", "12", "--low", "16", "--high", "40"]
    args += ["--max-batch", "16", "--chunk", "256", "--out", str(tmp_path)]
    args += ["--tokenizer", tokenizer] if tokenizer else []
    assert main(args) == 0, capsys.readouterr()
    report = json.loads((tmp_path / "http.json").read_text())
    expected = sum(output for _, output in workload(12, seed=0, vocab=500, low=16, high=40))
    rows = {row["path"]: row for row in report["rows"]}
    assert list(rows) == [
        "scheduler, in process (first pass, not compared)",
        "scheduler, in process",
        "AsyncEngine.generate, in process",
        "HTTP, httpx client, streamed (first pass, not compared)",
        "HTTP, httpx client, streamed",
        "HTTP, httpx client, not streamed",
        "HTTP, engine process, httpx client, streamed (first pass, not compared)",
        "HTTP, engine process, httpx client, streamed",
        "HTTP, engine process, httpx client, not streamed",
    ]
    for row in rows.values():
        assert row["output_tokens"] == expected, row
        assert 0.0 <= row["gpu_idle_fraction"] <= 1.0, row
        # every path, in process or through the server, places its device time from its own steps
        assert row["steps"] > 0 and 0 < row["prefill_steps"] < row["steps"], row
        assert 0 < row["mean_decode_rows"] <= 12 and row["idle_between_steps_s"] >= 0, row
        assert 0 <= row["idle_before_first_step_s"] < row["seconds"], row
    for name in ("HTTP, httpx client, streamed", "HTTP, httpx client, not streamed"):
        assert rows[name]["loop_cpu_s"] >= 0 and rows[name]["other_threads_cpu_s"] > 0, rows[name]
        assert "engine_process_cpu_s" not in rows[name]
    for name in (
        "HTTP, engine process, httpx client, streamed",
        "HTTP, engine process, httpx client, not streamed",
    ):
        assert rows[name]["engine_process_cpu_s"] > 0, rows[name]  # the scheduler's, in the other process
    for label in ("HTTP", "HTTP, engine process"):
        streamed = rows[f"{label}, httpx client, streamed"]
        assert (streamed["ttft_p50_ms"] is not None) == (tokenizer is not None)  # text arrives only with one
