"""Triton kernels compiled ahead in a compile-only pass (snugkv.kernels.compile_ahead): the switch,
the pass's bounds and errors, and the GEMM choosers that must not choose inside it (CPU); on a GPU,
an engine started with it serves the same tokens as one started without (`cuda`, run on the device)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from snugkv.kernels import compile_ahead
from snugkv.layers import dense_gemm_choice

REPO = Path(__file__).resolve().parents[2]


def test_switched_off_the_pass_does_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SNUGKV_COMPILE_AHEAD", raising=False)
    ran = []
    assert compile_ahead.run(lambda: ran.append(1), "nothing") is None and ran == []


def test_the_pass_is_bounded_and_its_errors_are_logged_not_raised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("triton.runtime._async_compile")
    from triton.runtime.jit import JITFunction

    monkeypatch.setenv("SNUGKV_COMPILE_AHEAD", "1")
    original = JITFunction.run
    seen = []

    def work() -> None:
        seen.append((compile_ahead.active(), JITFunction.run is not original))
        raise RuntimeError("a forward that stopped half way")

    caplog.set_level(logging.INFO, logger="snugkv.kernels.compile_ahead")
    assert compile_ahead.run(work, "a test", workers=2) == 0
    assert seen == [(True, True)]  # inside: this thread's launches compile only
    assert not compile_ahead.active() and JITFunction.run is original  # after: as before
    assert "compiling a test ahead stopped (RuntimeError: a forward that stopped half way)" in caplog.text
    assert "Compiled 0 Triton kernels for a test ahead on 2 threads" in caplog.text


def test_the_dense_gemm_chooser_compiles_its_candidates_and_keeps_no_choice_in_the_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    chooser = dense_gemm_choice.GemmChooser()
    ran = []
    candidates = [
        dense_gemm_choice.CUBLAS,
        dense_gemm_choice.Candidate("rows", lambda x, w, b: ran.append("rows") or x @ w.T),
        dense_gemm_choice.Candidate("broken", lambda x, w, b: ran.append("broken") or 1 / 0),
    ]
    monkeypatch.setattr(dense_gemm_choice, "CANDIDATES", candidates)
    monkeypatch.setattr(compile_ahead, "active", lambda: True)
    x, weight = torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    assert chooser.pick(x, weight, None) is dense_gemm_choice.CUBLAS
    assert ran == ["rows", "broken"] and chooser.choices == {} and chooser.timings == []


SCRIPT = r"""
import json, logging, os
from snugkv.bench.model_configs import benchmark_model
from snugkv.core.sampling import SamplingParams
from snugkv.driver.commands import Add
from snugkv.driver.engine_core import EngineCore
from snugkv.engine import Engine, EngineArgs
from snugkv.layers.dense_gemm_choice import CHOOSER

lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("snugkv").addHandler(Keep())
logging.getLogger("snugkv").setLevel(logging.INFO)
saved = os.environ.get("SAVED_MODEL")  # a tiny MoE checkpoint, else the 0.6B shape with random weights
model = dict(model=saved) if saved else dict(model=benchmark_model("qwen3-0.6b"), load_format="dummy")
engine = Engine(EngineArgs.of(**model, device="cuda",
                              max_running_requests=8, cuda_graph_max_bs=8, chunked_prefill_size=128,
                              prefill_graph_max_tokens=256, max_total_tokens=1 << 14, weights_seed=3))
core = EngineCore.around(engine, tokenizer=None)
greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
requests = core.submit([Add("long", [5, 6, 7, 8] * 50, greedy), Add("short", [9, 10, 11], greedy)])
core.run()
print(json.dumps({"ahead": [line for line in lines if "ahead" in line], "choices": len(CHOOSER.choices),
                  "tokens": [list(request.output_ids) for request in requests],
                  "timings": engine.report.timings}))
engine.close()
"""


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["qwen3-0.6b", "qwen3_moe"])
def test_an_engine_that_compiled_ahead_starts_and_serves(tmp_path: Path, model: str) -> None:
    """The MoE case checks that no torch op reads what a skipped Triton launch left unwritten."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run scripts/gpu_check.sh on the device)")
    saved = {}
    if model == "qwen3_moe":
        from tests.models.hf_tiny import save_tiny_hf_model

        save_tiny_hf_model(model, tmp_path / "model")
        saved = {"SAVED_MODEL": str(tmp_path / "model")}
    results = {}
    for switch in ("0", "1"):
        env = {
            **os.environ,
            **saved,
            "SNUGKV_COMPILE_AHEAD": switch,
            "TRITON_CACHE_DIR": str(tmp_path / f"triton-{switch}"),  # cold, as on a fresh machine
            "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        result = subprocess.run(
            [sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=400
        )
        assert result.returncode == 0, result.stderr[-4000:]
        results[switch] = json.loads(result.stdout.strip().splitlines()[-1])
    print(
        json.dumps({switch: {"ahead": r["ahead"], "timings": r["timings"]} for switch, r in results.items()})
    )
    assert results["0"]["ahead"] == []
    decode = [line for line in results["1"]["ahead"] if "for the decode graphs" in line]
    assert decode and not decode[0].startswith("Compiled 0 "), results["1"]["ahead"]
    assert results["1"]["choices"] > 0  # the warm-up after the pass still chose the small-batch GEMMs
    assert results["1"]["tokens"] == results["0"]["tokens"]  # the same random weights, greedy
    assert all(len(tokens) == 12 for tokens in results["1"]["tokens"])
