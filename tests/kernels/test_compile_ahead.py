"""Triton kernels compiled ahead in a compile-only pass (snugkv.kernels.compile_ahead): the switch,
the pass's bounds and errors, its worker processes compiling into Triton's cache what the warm-up
then finds, and the GEMM choosers that must not choose inside it (CPU); on a GPU, an engine started
with it serves the same tokens as one started without and compiles nothing the workers did not
(`cuda`, run on the device)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from snugkv.kernels import compile_ahead, compile_workers
from snugkv.layers import dense_gemm_choice

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _decide_afresh() -> Iterator[None]:
    """Each test's switch is read anew (a process decides once)."""
    compile_workers.forget_decision()
    yield
    compile_workers.forget_decision()


def test_switched_off_the_pass_does_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SNUGKV_COMPILE_AHEAD", "0")
    ran = []
    assert compile_ahead.run(lambda: ran.append(1), "nothing") is None and ran == []


@pytest.mark.parametrize(
    ("switch", "gpu", "cached", "on"),
    [
        (None, True, False, True),  # a fresh machine with a GPU: its start compiles everything
        (None, True, True, False),  # kernels in the cache already: the workers' imports would cost
        (None, False, False, False),  # no NVIDIA GPU (a CPU machine, CI)
        ("1", False, True, True),
        ("0", True, False, False),
    ],
)
def test_unset_it_is_on_for_a_gpu_start_with_an_empty_triton_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, switch: str | None, gpu: bool, cached: bool, on: bool
) -> None:
    if switch is None:
        monkeypatch.delenv("SNUGKV_COMPILE_AHEAD", raising=False)
    else:
        monkeypatch.setenv("SNUGKV_COMPILE_AHEAD", switch)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    if cached:
        (tmp_path / "cache" / "SOMEKERNELHASH").mkdir(parents=True)
    monkeypatch.setattr(compile_workers, "has_nvidia_gpu", lambda: gpu)
    assert compile_workers.enabled() is on
    (tmp_path / "cache" / "ANOTHER").mkdir(parents=True, exist_ok=True)  # the start's first compile
    assert compile_workers.enabled() is on  # decided once
    compile_workers.stop()  # the start is done: a later one in this process compiles as before
    assert compile_workers.enabled() is (switch == "1")


def test_a_switch_value_it_does_not_know_is_auto_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SNUGKV_COMPILE_AHEAD", "maybe")
    monkeypatch.setattr(compile_workers, "has_nvidia_gpu", lambda: False)
    assert compile_workers.enabled() is False
    assert "SNUGKV_COMPILE_AHEAD='maybe' is not 0, 1 or auto: taken as auto" in caplog.text


def test_triton_s_cache_folder_is_found_as_triton_finds_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("triton")
    from triton import knobs

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    assert compile_workers.triton_cache_dir() == knobs.cache.dir
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert compile_workers.triton_cache_dir() == knobs.cache.dir == str(tmp_path / "elsewhere")


HAND_OVER = r"""
import inspect, json, logging, os, sys
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime import jit
from triton.runtime.jit import JITFunction, JitFunctionInfo
from snugkv.kernels import compile_workers
from snugkv.kernels import compile_ahead, norm

# A specialization of the RMSNorm kernel as a launch on an sm_90 GPU would make it.
fn = norm._rms_norm_kernel
names = [param.name for param in fn.params]
pointers = ("X", "Residual", "PreNormWeight", "Weight", "Out", "ResidualOut")
kinds = {name: "*bf16" for name in pointers} | {"eps": "fp32"}
constexprs = {"HAS_RESIDUAL": True, "HAS_PRE_NORM": False, "GEMMA": False, "BLOCK": 1024}
signature = {name: "constexpr" if name in constexprs else kinds.get(name, "i32") for name in names}
constants = {(names.index(name),): value for name, value in constexprs.items()}
attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in pointers}
target = GPUTarget("cuda", 90, 32)
options = make_backend(target).parse_options({"num_warps": 2})
arguments = [fn._fn_name, signature, constants, attrs, options, "a key"]
if "target" in inspect.signature(jit.serialize_specialization_data).parameters:  # Triton 3.9
    arguments.append(target)
spec = jit.serialize_specialization_data(*arguments)  # what Triton's compile hook hands over

lines, answers = [], []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("snugkv").addHandler(Keep())
logging.getLogger("snugkv").setLevel(logging.INFO)
original_run, original_hook = JITFunction.run, knobs.runtime.jit_cache_hook

def work():  # a launch, played as JITFunction._do_compile calls the hook: twice, the same kernel
    assert compile_ahead.active() and JITFunction.run is not original_run
    for _ in range(2):
        answers.append(knobs.runtime.jit_cache_hook(
            key="a key", repr="_rms_norm_kernel", fn=JitFunctionInfo(fn.fn.__module__, fn.fn.__qualname__, fn),
            compile={"key": "a key", "specialization_data": spec}, is_manual_warmup=False, already_compiled=False))

sent = compile_ahead.run(work, "a test", target=target)
worker_answers = compile_workers.running().answers
compile_workers.stop()
cache = os.environ["TRITON_CACHE_DIR"]
compiled = sorted(os.listdir(cache))
# the warm-up's launch compiles the same specialization from the same source: a cache hit
kernel = triton.compile(ASTSource(fn, signature, constants, attrs), target=target, options=options.__dict__)
print(json.dumps({"sent": sent, "answers": answers, "worker_answers": worker_answers, "lines": lines, "compiled": compiled,
                  "after": sorted(os.listdir(cache)), "name": kernel.name,
                  "restored": [JITFunction.run is original_run, knobs.runtime.jit_cache_hook is original_hook,
                               compile_ahead.active()]}))
"""


def test_a_pass_hands_each_kernel_to_the_workers_and_the_warm_up_finds_it_compiled(tmp_path: Path) -> None:
    """On a CPU too (the workers compile for an sm_90 target), in a fresh interpreter: the tests run
    Triton's interpreter, whose kernels are no `JITFunction`."""
    pytest.importorskip("triton")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env |= {
        "SNUGKV_COMPILE_AHEAD": "1",
        "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"),
        "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    result = subprocess.run(
        [sys.executable, "-c", HAND_OVER], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["sent"] == 1 and seen["answers"] == [True, True]  # a launch then returns uncompiled
    assert seen["restored"] == [True, True, False]
    assert any(line.startswith("Compiled 1 Triton kernels for a test ahead in ") for line in seen["lines"]), (
        seen
    )
    assert any("(slowest: _rms_norm_kernel " in line for line in seen["lines"]), seen["lines"]
    assert seen["compiled"] and seen["name"] == "_rms_norm_kernel"
    assert seen["after"] == seen["compiled"]  # the warm-up's compile added nothing to the cache
    # the worker imported every kernel module and compiled without loading torch
    assert [answer["torch"] for answer in seen["worker_answers"]] == [False]


def test_a_specialization_no_worker_can_compile_is_left_to_the_warm_up(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("SNUGKV_COMPILE_AHEAD", "1")
    monkeypatch.setenv("PYTHONPATH", f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    workers = compile_workers.start(count=1)
    assert workers is not None
    try:
        workers.submit(
            {"module": "snugkv.kernels.norm", "name": "no_such_kernel", "spec": "{}", "target": []}
        )
        assert workers.wait(60)
    finally:
        compile_workers.stop()
    assert workers.answers[0]["ok"] is False and "AttributeError" in workers.answers[0]["error"]


def test_a_job_submitted_again_is_the_first_and_a_wait_covers_the_jobs_it_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two passes that meet the same specialization share its job (one compile); a capture waits
    for its own pass's jobs, first come first served, not for the jobs handed over after them."""
    pytest.importorskip("triton")
    monkeypatch.setenv("SNUGKV_COMPILE_AHEAD", "1")
    monkeypatch.setenv("PYTHONPATH", f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    workers = compile_workers.start(count=1)
    assert workers is not None

    def job(name: str) -> dict[str, object]:
        return {"module": "snugkv.kernels.norm", "name": name, "spec": "{}", "target": []}

    try:
        first = workers.submit(job("no_such_kernel"))
        assert workers.submit(job("no_such_kernel")) == first  # the same job: compiled once
        assert workers.wait(60, [first])
        later = workers.submit(job("another_missing_kernel"))
        assert later != first
        assert workers.wait(60)  # every job
    finally:
        compile_workers.stop()
    assert [answer["id"] for answer in workers.answers] == [first, later]
    assert all(answer["ok"] is False for answer in workers.answers)


def test_an_engine_process_can_start_the_workers_before_its_own_imports() -> None:
    """The engine process starts them first thing (commands/engine_spawn.py): the pool's module
    imports neither torch nor triton nor the rest of snugkv."""
    probe = "import sys, snugkv.kernels.compile_workers; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton') or m.startswith('snugkv.')))"
    result = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['snugkv.kernels', 'snugkv.kernels.compile_workers', 'snugkv.version']"


def test_the_pass_is_bounded_and_its_errors_are_logged_not_raised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    monkeypatch.setenv("SNUGKV_COMPILE_AHEAD", "1")
    original = JITFunction.run
    seen = []

    def work() -> None:
        seen.append((compile_ahead.active(), JITFunction.run is not original))
        raise RuntimeError("a forward that stopped half way")

    caplog.set_level(logging.INFO, logger="snugkv.kernels.compile_ahead")
    assert compile_ahead.run(work, "a test", target=GPUTarget("cuda", 90, 32)) == 0
    assert seen == [(True, True)]  # inside: this thread's launches compile only
    assert not compile_ahead.active() and JITFunction.run is original  # after: as before
    assert "compiling a test ahead stopped (RuntimeError: a forward that stopped half way)" in caplog.text
    assert "Compiled 0 Triton kernels for a test ahead in 0 processes" in caplog.text


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
    """The MoE case checks that no torch op reads what a skipped Triton launch left unwritten; both,
    that the warm-up after the pass compiles nothing the workers did not."""
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
    # Each compiled kernel is a folder of Triton's cache: had a worker's compile not been the one the
    # warm-up looked for (another cache key), the warm-up would have compiled it again, beside it.
    compiled = {switch: len(list((tmp_path / f"triton-{switch}").iterdir())) for switch in ("0", "1")}
    assert compiled["1"] == compiled["0"], compiled
    assert all(len(tokens) == 12 for tokens in results["1"]["tokens"])
