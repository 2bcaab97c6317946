"""`snugkv bench` as a user meets it: a GPU benchmark on a CPU says so in one line, the shipped
model configs are found from any directory, and a failed row fails the run."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest
import torch

from snugkv.bench import capacity
from snugkv.bench.model_configs import benchmark_model
from snugkv.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only machine")
@pytest.mark.parametrize("benchmark", ["capacity", "decode", "serving", "kernels", "attention", "prefill"])
def test_a_gpu_benchmark_on_a_cpu_says_it_needs_a_cuda_gpu(capsys, benchmark):
    assert main(["bench", benchmark]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: bench {benchmark} needs a CUDA GPU") and len(err.splitlines()) == 1


@pytest.mark.parametrize("name", ["llama-3-8b", "qwen3-0.6b", "configs/llama-3-8b", "qwen3-30b-a3b"])
def test_shipped_configs_are_found_from_any_directory(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    assert (Path(benchmark_model(name)) / "config.json").is_file()


def test_an_unknown_model_lists_the_shipped_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        argparse.ArgumentTypeError,
        match=r"llama-3-8b, llama-3-8b-eagle3, mixtral-8x7b, qwen3-0\.6b, qwen3-30b-a3b",
    ):
        benchmark_model("no-such-model")


def test_bench_capacity_fails_when_a_row_failed(tmp_path, monkeypatch, capsys):
    """One mode starts, one worker dies without a result: the table comes out and the exit code is 1."""
    outcomes = iter(
        [
            json.dumps(
                {"model": "qwen3-0.6b", "mode": "post-capture", "max_total_num_tokens": 64, "oom": False}
            ),
            "",
        ]
    )

    real_run = subprocess.run

    def fake_worker(command, **kwargs):
        if "--worker" not in command:  # platform.processor() and the like
            return real_run(command, **kwargs)
        return subprocess.CompletedProcess(command, 1, stdout=next(outcomes), stderr="")

    monkeypatch.setattr(capacity, "cuda_missing", lambda what: False)
    monkeypatch.setattr(capacity.subprocess, "run", fake_worker)
    parser = argparse.ArgumentParser()
    capacity.add_arguments(parser)
    args = parser.parse_args(["--models", "qwen3-0.6b", "--modes", "post-capture", "profiled"])
    args.out = None
    assert capacity.run(args) == 1
    captured = capsys.readouterr()
    assert "| qwen3-0.6b | profiled |" in captured.out
    assert "1 of 2 rows failed: qwen3-0.6b profiled" in captured.err


@pytest.mark.parametrize("overlap", [True, False])
def test_bench_serving_reports_the_gpu_idle_fraction_with_overlap_on_and_off(tmp_path, overlap):
    """The in-process run the serving bench times, on a CPU with a tiny model: same tokens either
    way, and an idle fraction in [0, 1)."""
    from snugkv.bench.serving import run_scheduler, workload
    from snugkv.engine import Engine, EngineArgs
    from tests.models.hf_tiny import save_tiny_hf_model

    save_tiny_hf_model("llama", tmp_path)
    engine = Engine(
        EngineArgs.of(model=str(tmp_path), dtype="float32", host_kv_gib=0.02, max_running_requests=4)
    )
    result = run_scheduler(engine, workload(6, seed=0, vocab=300, low=4, high=12), overlap=overlap)
    engine.close()
    assert result["requests"] == 6 and result["overlap"] == ("on" if overlap else "off")
    assert 0 <= result["gpu_idle_fraction"] < 1
    steps_read, steps = map(int, result["overlapped_steps"].split("/"))
    assert steps > 0 and (steps_read > 0) == overlap


def test_bench_host_times_the_scheduler_with_the_model_stubbed_on_a_cpu(capsys):
    assert main(["bench", "host", "--batch", "8", "--prompt", "8", "--steps", "20", "--repeats", "2"]) == 0
    table = capsys.readouterr().out
    for mode in ("on", "off"):
        assert (
            f"| {mode} | steady: 8 requests decoding |" in table and f"| {mode} | drain: 8 requests" in table
        )


def test_the_elastic_bench_clock_counts_a_resizes_driver_calls_and_leaves_no_wrapper():
    from snugkv.bench.elastic import _timed_resize
    from snugkv.engine import Engine, EngineArgs
    from tests.runner.tiny_runner import tiny_config_path

    engine = Engine(
        EngineArgs.of(
            model=str(tiny_config_path()),
            load_format="dummy",
            dtype="float32",
            host_kv_gib=0.05,
            max_total_tokens=4096,
            kv_chunk_mib=1 / 256,  # one 4 KiB page: the tiny buffers shrink page by page
        )
    )
    vmm = engine.pool.arena.vmm
    try:
        _, shrunk, calls = _timed_resize(engine, 1024)
        # a shrink unmaps whole extensions once queued kernels are done; it commits nothing
        assert shrunk.to_tokens == 1024
        assert all(f"{name} " in calls for name in ("decommit_many", "synchronize")), calls
        assert "commit_pieces" not in calls, calls
        _, grown, calls = _timed_resize(engine, 4096)
        assert grown.to_tokens == 4096 and calls.startswith("commit_pieces ") and "decommit" not in calls, (
            calls
        )
        assert "commit_pieces" not in vars(vmm) and "synchronize" not in vars(engine.pool.arena)
    finally:
        engine.close()


@pytest.mark.slow
def test_bench_structured_runs_constrained_rows_to_the_full_output_on_a_cpu():
    """The measurement `bench structured` times, on a CPU with the embedded SmolLM2: a quarter of
    the batch under the endless JSON schema generates as many tokens as the unconstrained batch."""
    pytest.importorskip("xgrammar")
    from snugkv.bench.structured import measure
    from snugkv.engine import Engine, EngineArgs
    from snugkv.models import default_model
    from snugkv.models.loader import ModelSource
    from snugkv.models.tokenizer import load_tokenizer

    path = default_model.default_model_path()
    engine = Engine(EngineArgs.of(model=str(path), dtype="float32", host_kv_gib=0.05, max_running_requests=8))
    tokenizer = load_tokenizer(ModelSource(path, "gguf"))
    try:
        options = {"batch": 8, "input_len": 8, "output_len": 12}
        plain = measure(engine, tokenizer, constrained_every=0, **options)
        requests: list = []
        constrained = measure(engine, tokenizer, constrained_every=4, finished=requests, **options)
    finally:
        engine.close()
    assert plain["constrained_rows"] == 0 and constrained["constrained_rows"] == 2
    assert plain["output_tokens"] == constrained["output_tokens"] == 8 * 12
    assert constrained["output_tok_per_s"] > 0
    texts = [tokenizer.decode(r.output_ids) for r in requests if r.sampling.structured is not None]
    assert len(texts) == 2 and all(text.startswith('[{"id":') for text in texts), texts
