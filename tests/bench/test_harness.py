"""The one harness every benchmark writes through: the raw JSON keeps the keys docs/bench/raw/*.json
document, the table sits beside it under a heading that names device, torch, date and commit, and
percentiles are nearest-rank on the milliseconds."""

from __future__ import annotations

import json

from snugkv.bench.harness import emit, latency_columns, percentile_ms, save

ENVIRONMENT_KEYS = {"date", "commit", "python", "torch", "device"}


def test_emit_writes_benchmark_environment_rows_then_the_benchmarks_own_keys(tmp_path, capsys):
    rows = [{"batch": 1, "step_ms": 2.5, "nested": {"kept": "in the JSON"}}, {"batch": 64, "step_ms": 3.0}]
    emit("decode", rows, str(tmp_path / "out"), extra={"copy_bandwidth_gb_per_s": 4000.0})

    raw = json.loads((tmp_path / "out" / "decode.json").read_text())
    assert list(raw) == ["benchmark", "environment", "rows", "copy_bandwidth_gb_per_s"]
    assert raw["benchmark"] == "decode" and raw["rows"] == rows
    assert set(raw["environment"]) == ENVIRONMENT_KEYS
    table = (tmp_path / "out" / "decode.md").read_text()
    heading = f"## decode — {raw['environment']['device']}, torch {raw['environment']['torch']}"
    assert table.startswith(heading)
    assert "| batch | step_ms |" in table and "| 1 | 2.500 |" in table and "nested" not in table
    assert capsys.readouterr().out.startswith(heading)


def test_save_without_rows_writes_only_the_json(tmp_path):
    save(tmp_path / "deeper" / "fuzz.json", {"statuses": {}, "after": 200})
    assert json.loads((tmp_path / "deeper" / "fuzz.json").read_text()) == {"statuses": {}, "after": 200}
    assert not (tmp_path / "deeper" / "fuzz.md").exists()


def test_a_peer_record_without_torch_device_titles_its_table_with_the_gpu(tmp_path):
    env = {"date": "2026-12-01 10:00:00", "commit": "abc1234", "gpu": "NVIDIA H100", "torch": "2.11"}
    save(
        tmp_path / "peers.json", {"benchmark": "peers", "environment": env, "rows": []}, [{"engine": "vllm"}]
    )
    table = (tmp_path / "peers.md").read_text()
    assert table.startswith("## peers — NVIDIA H100, torch 2.11, 2026-12-01 10:00:00, commit abc1234")


def test_percentiles_are_nearest_rank_in_milliseconds_and_none_when_nothing_was_measured():
    seconds = [0.004, 0.001, 0.003, 0.002]  # unsorted, as requests finish
    assert percentile_ms(seconds, 0.5) == 3.0  # rank int(0.5 * 4) = 2 of the sorted
    assert percentile_ms(seconds, 0.99) == 4.0
    assert percentile_ms([], 0.5) is None
    columns = latency_columns([0.1], [])
    assert columns == {"ttft_p50_ms": 100.0, "ttft_p99_ms": 100.0, "tpot_p50_ms": None, "tpot_p99_ms": None}
