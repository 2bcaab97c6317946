"""`bench decode --quantization fp8` assembles its table from the two engines' cases: checked on CPU
with the cases stubbed (the real ones need a GPU), for a dense and a MoE model, so a missing column
cannot sink the one device run."""

from __future__ import annotations

import argparse
import json

import pytest

from snugkv.bench import decode


def _case(batch: int, graph_ms: float, moe: bool) -> dict:
    row = {
        "batch": batch,
        "context": 1024,
        "graph_ms": graph_ms,
        "piecewise_ms": graph_ms * 1.1,
        "step_ms": graph_ms * 1.05,
        "weight_bytes": 8 << 30,
        "kv_bytes": batch << 27,
        "kv_tokens": 1_000_000,
        "kernels_per_layer": 12.0,
        "kernel_ms_by_kind": {"gemm": graph_ms / 2},
    }
    if moe:
        row |= {"moe_ms": graph_ms / 2, "experts_touched": [8, 8, 6], "touched_expert_bytes": 3 << 30}
    return row


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_the_side_by_side_table_has_both_engines_and_the_choice_summary(monkeypatch, tmp_path, capsys, moe):
    calls = []

    def cases(model, cases, *, breakdown, quantization, fill_tokens, stress):
        calls.append((quantization, stress))
        scale = 0.7 if quantization else 1.0
        return [_case(batch, 4.0 * scale * (1 + batch / 64), moe) for batch, _ in cases], 0, 0

    monkeypatch.setattr(decode, "snugkv_cases", cases)
    args = argparse.Namespace(model="shape", max_batch=256, quantization="fp8", out=str(tmp_path))
    assert decode.fp8_side_by_side(args, bandwidth=4.2e12) == 0
    assert calls == [(None, False), ("fp8", False)]  # no capacity stress in the side-by-side
    payload = json.loads((tmp_path / "decode_fp8.json").read_text())
    rows = payload["rows"]
    assert [row["batch"] for row in rows] == [1, 64, 256]
    assert rows[0]["fp8_over_bf16"] == pytest.approx(0.7)
    assert ("fp8_moe_over_bf16" in rows[0]) == moe
    if moe:
        assert rows[0]["experts_touched_per_layer"] == pytest.approx(22 / 3)
    assert set(payload["fp8_gemm_choice"]) == {"keys", "timed_runs", "seconds"}
    assert "FP8 GEMM choice:" in capsys.readouterr().out


def test_the_http_comparison_starts_a_bf16_then_an_fp8_server_on_the_same_workload(monkeypatch, tmp_path):
    from snugkv.bench import http_load

    commands, workloads = [], []

    def served(command, requests, streams):
        commands.append(command)
        workloads.append(requests)
        fp8 = "--quantization" in command
        return [{"output_tok_per_s": 1300.0 if fp8 else 1000.0, "seconds": 10.0}]

    monkeypatch.setattr(http_load, "run_on_server", served)
    parser = argparse.ArgumentParser()
    http_load.add_arguments(parser)
    args = parser.parse_args(["--model", "qwen3-0.6b", "--quantization", "fp8", "--requests", "8"])
    args.out = str(tmp_path)
    args.model = http_load.benchmark_model(args.model)  # as run() resolves it before run_fp8
    assert http_load.run_fp8(args) == 0
    assert commands[1][-2:] == ["--quantization", "fp8"] and "--quantization" not in commands[0]
    assert workloads[0] == workloads[1] and len(workloads[0]) == 8
    payload = json.loads((tmp_path / "http_fp8.json").read_text())
    assert payload["fp8_over_bf16_tok_per_s"] == pytest.approx(1.3)
    assert [row["weights"] for row in payload["rows"]] == ["bf16", "fp8"]
