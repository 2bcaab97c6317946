"""The host tier's copy micro-benchmark on CPU (the same code a GPU runs): both copy paths move the
same scattered pages back bit for bit, and the batched one issues far fewer copies."""

from __future__ import annotations

import torch

from snugkv.bench.host_tier_copies import copy_paths, kv_shape
from snugkv.bench.model_configs import benchmark_model


def test_both_paths_load_the_written_pages_and_the_batched_one_issues_fewer_copies():
    page_bytes = 4 * 4 * 64
    result = copy_paths(
        buffers=4, token_bytes=64, tokens=120, page_size=4, device=torch.device("cpu"),
        staging_bytes=256 + 8 * (page_bytes + 8), repeats=2,
    )  # fmt: skip
    assert result["copy_bench_pages"] == 30 and result["copy_bench_buffers"] == 4
    for path in ("per_run", "batched"):
        assert result[f"{path}_pages_match"], path
        assert result[f"{path}_load_gb_per_s"] > 0 and result[f"{path}_write_gb_per_s"] > 0
    # 30 scattered pages onto 30 host pages (mostly runs of one) x 4 buffers, against 4 chunks of 8
    assert result["batched_copies_per_load"] <= 4 * (1 + 1 + 4) < result["per_run_copies_per_load"]


def test_the_shape_is_one_fused_kv_buffer_per_layer():
    assert kv_shape(benchmark_model("llama-3-8b")) == (32, 2 * 8 * 128 * 2)
