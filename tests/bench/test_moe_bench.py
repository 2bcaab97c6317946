"""The MoE rows of `bench decode`, `bench prefill` and the kernel tuner, run on a CPU with a tiny
MoE model and the device timers stubbed: the bookkeeping (floors, experts touched, active
parameters, the tuned table) is what these check; the GPU run gives the times."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from snugkv.bench import decode, moe_tune, prefill
from snugkv.kernels.moe_experts import GemmConfig, MoEConfig, default_config
from snugkv.kernels.moe_routing import Routing
from tests.models.hf_tiny import tiny_hf_config


def _once(fn, *args, **kwargs) -> float:
    fn()
    return 1e-3


@pytest.fixture
def tiny_moe(tmp_path):
    """A Qwen3-MoE config.json (3 layers, the middle one dense, 8 experts, top-2) for dummy weights."""
    path = tmp_path / "tiny-moe"
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps(tiny_hf_config("qwen3_moe", max_position_embeddings=2048).to_dict())
    )
    return str(path)


@pytest.mark.slow  # an engine start and three decode batches up to 64 x 1k on a CPU
def test_decode_bench_moe_rows_count_the_experts_the_batch_touches(tiny_moe, tmp_path, monkeypatch):
    monkeypatch.setattr(decode, "cuda_missing", lambda what: False)
    monkeypatch.setattr(decode, "copy_bandwidth_bytes_per_s", lambda: 1e12)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)  # the stress on a CPU
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 0)
    monkeypatch.setattr(decode, "time_cuda", _once)
    monkeypatch.setattr(decode, "graph_seconds", _once)
    monkeypatch.setattr(
        decode,
        "kernel_breakdown",
        lambda step, layers: {
            "kernels_per_step": 0,
            "kernels_per_layer": 0.0,
            "kernel_ms_by_kind": {},
            "kernels_by_kind": {},
        },
    )
    args = argparse.Namespace(
        model=tiny_moe, max_batch=64, transformers=False, unfused=True, out=str(tmp_path), quantization=None
    )
    assert decode.run(args) == 0
    report = json.loads((tmp_path / "decode.json").read_text())
    rows = report["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 1024), (64, 1024)]
    # 2 MoE layers of 8 experts, hidden 64, I = 32: an expert is 3 * 64 * 32 float32 values
    expert_bytes = 3 * 64 * 32 * 4
    for row in rows:
        touched = row["experts_touched_per_layer"] * 2
        assert row["touched_expert_gb"] * 1e9 == pytest.approx(touched * expert_bytes)
        assert 2 <= row["experts_touched_per_layer"] <= 8
        assert row["moe_ms"] == 1.0 and row["moe_over_floor"] > 0 and "gemm_floor_ms" not in row
        assert "unfused_graph_ms" not in row  # no op-by-op baseline for MoE models
    assert rows[0]["experts_touched_per_layer"] == 2  # one token, top-2
    assert rows[1]["experts_touched_per_layer"] > 2  # 64 different tokens spread out
    from snugkv.models.loader import load_model

    net = load_model(tiny_moe, load_format="dummy").model
    every = sum(p.numel() for p in net.parameters()) * 4
    routed = 2 * 8 * expert_bytes
    embedding = 320 * 64 * 4  # untied: a decode step reads only its rows of the embedding
    assert rows[0]["dense_weight_gb"] * 1e9 == pytest.approx(every - routed - embedding)
    startup = report["startup"][0]
    assert startup["memory_ledger"]["kv_committed_bytes"] > 0
    assert startup["oom"] is False and startup["pool_in_use"] > 0.5  # the stress ran over the pool


def test_prefill_bench_floor_counts_active_parameters(tiny_moe, monkeypatch):
    monkeypatch.setattr(prefill, "time_cuda", _once)
    rows = prefill._cases(tiny_moe, ((64, 4),))
    (row,) = rows
    assert row["tokens"] == 64 and row["piecewise_ms"] == 1.0
    from snugkv.models.loader import load_model
    from snugkv.models.moe import parameter_counts

    net = load_model(tiny_moe, load_format="dummy").model
    total, active = parameter_counts(net)
    counted = active - net.model.embed_tokens.weight.numel()  # untied: the LM head counts, the embedding not
    assert row["active_params_b"] * 1e9 == counted
    assert row["floor_ms"] == pytest.approx(2 * counted * 64 / prefill.DENSE_BF16_FLOPS * 1e3)
    assert active < total


def test_the_tuner_keeps_the_fastest_config_per_token_count():
    routing = Routing(num_experts=8, top_k=2, renormalize=True)

    def cost(config: MoEConfig, call) -> float:  # made-up times: 32-row blocks, 64-wide down tiles win
        return 1.0 + (config.block_m != 32) + (config.down.block_n != 64) * 0.5 + config.small_batch * 0.1

    result = moe_tune.tune(64, routing, 32, 16, timer=cost, deadline=math.inf, device="cpu")
    best = result["best"]
    assert best.block_m == 32 and best.down.block_n == 64 and not best.small_batch
    assert result["default_s"] == cost(default_config(64, 2, 8), None)
    assert result["best_s"] == 1.0


def test_tuned_entries_cover_up_to_the_geometric_mean_with_the_next_count():
    config = MoEConfig(16, GemmConfig(64, 128), GemmConfig(64, 128), small_batch=True)
    entries = moe_tune.table_entries([{"tokens": t, "best": config} for t in (256, 1, 64)])
    assert [e["max_tokens"] for e in entries] == [8, 128, 1 << 30]
    assert entries[0] == {
        "max_tokens": 8,
        "block_m": 16,
        "gate_up": [64, 128, 1, 4, 3],
        "down": [64, 128, 1, 4, 3],
        "small_batch": True,
        "tuned_at_tokens": 1,
    }


def test_the_tuner_reads_the_geometry_of_the_models_moe_layers(tiny_moe):
    routing, hidden, intermediate = moe_tune.moe_geometry(tiny_moe)
    assert (routing.num_experts, routing.top_k, routing.renormalize, hidden, intermediate) == (
        8,
        2,
        True,
        64,
        32,
    )
    assert decode.is_moe_model(tiny_moe)
    assert not decode.is_moe_model(str(decode.benchmark_model("qwen3-0.6b")))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only machine")
def test_the_tuner_on_a_cpu_says_it_needs_a_cuda_gpu(capsys):
    assert moe_tune.main(["--tokens", "1"]) == 2
    assert capsys.readouterr().err.startswith("error: bench moe_tune needs a CUDA GPU")


@pytest.mark.parametrize("direct_wins", [True, False])
def test_the_tuner_times_the_direct_path_for_a_few_tokens_and_the_table_says_which_won(
    direct_wins, monkeypatch
):
    from snugkv.kernels.moe_direct import DirectConfig

    monkeypatch.delenv("SNUGKV_MOE_DIRECT_TOKENS", raising=False)
    routing = Routing(num_experts=8, top_k=2, renormalize=True)

    def cost(config: MoEConfig, call) -> float:  # made-up times: gate/up steps of 8 x 1024 win
        if config.direct is None:
            return 2.0
        faster_tiles = (config.direct.gate_up_block_n, config.direct.gate_up_block_k) == (8, 1024)
        return (1.0 if direct_wins else 3.0) - 0.5 * faster_tiles

    result = moe_tune.tune(1, routing, 32, 16, timer=cost, deadline=math.inf, device="cpu")
    (entry,) = moe_tune.table_entries([result])
    assert result["sorted_s"] == 2.0 and result["direct_s"] == (0.5 if direct_wins else 2.5)
    if direct_wins:
        assert result["best"].direct == DirectConfig(8, 1024, 4, 1024, 4)  # k=2: down steps of 1024
        assert entry["direct"] == [8, 1024, 4, 1024, 4]
    else:
        assert result["best"].direct is None and entry["direct"] is None
    assert result["default_s"] == cost(default_config(1, 2, 8), None)  # what runs without a table
    many = moe_tune.tune(64, routing, 32, 16, timer=cost, deadline=math.inf, device="cpu")
    assert not many["direct_timed"] and "direct" not in moe_tune.table_entries([many])[0]
