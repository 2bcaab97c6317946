"""`snugkv bench elastic` on CPU: one line and exit 2; its measuring functions run end to end on a
tiny CPU engine (with the CUDA calls stood in for), so the GPU run does not fail on a slip."""

from __future__ import annotations

import argparse

import pytest
import torch

from snugkv.bench import elastic as bench
from snugkv.engine import Engine, EngineArgs
from snugkv.memory.vmm import GIB
from tests.models.hf_tiny import save_tiny_hf_model


def test_on_cpu_the_bench_says_it_needs_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args([])) == 2
    assert capsys.readouterr().err.strip().startswith("error: bench elastic needs a CUDA GPU")


def test_the_measurements_run_on_a_tiny_cpu_engine(tmp_path, monkeypatch):
    save_tiny_hf_model("llama", tmp_path)
    monkeypatch.setattr(bench, "_sync", lambda: None)
    monkeypatch.setattr(bench, "_device_used_bytes", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    engine = Engine(
        EngineArgs.of(model=str(tmp_path), dtype="float32", host_kv_gib=0.02, page_size=4, kv_chunk_mib=1)
    )
    per_gib = GIB / engine.pool.bytes_per_token
    deltas = (1000 / per_gib, 4000 / per_gib)  # about 1000 and 4000 tokens
    rows = bench.resize_rows(engine, 1e9, 1, move_gib=400 / per_gib, deltas_gib=deltas)
    assert [row["case"].split()[0] for row in rows] == ["shrink/grow", "shrink"] * 2
    assert all(row["shrink_ms"] > 0 for row in rows)
    assert rows[1]["case"].endswith("live KV") and rows[1]["resized_gib"] > 0
    rows = bench.sleep_rows(engine)
    assert [row["same_greedy_tokens"] for row in rows] == [True, True, True]
    assert [row["recaptured"] for row in rows] == [False, False, True]  # the third releases the graphs
    rows = bench.serving_rows(engine, requests=8, prompt=40, output=24, resize_every=4)
    assert rows[1]["same_outputs"] and rows[1]["resizes"] > 0 and rows[1]["retractions"] == 0
    assert rows[1]["moved_pages"] > 0 and rows[0]["finished"] == rows[1]["finished"] == 8
    engine.close()


@pytest.mark.parametrize("name", ["elastic"])
def test_the_bench_is_registered(name):
    from snugkv.commands.bench import BENCHMARKS

    assert BENCHMARKS[name] == "snugkv.bench.elastic"
