"""scripts/startup_check.py on CPU: a real `snugkv serve` of a tiny random-weights config is timed
from its spawn to the first healthy answer, every phase is there (the engine's from /server_info)
and the phases add up to no more than the total; one token-id completion is served, and SIGTERM
stops the server with exit code 0."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from snugkv.bench.model_configs import write_tiny_llama_config

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PHASES = {
    "process_age_s",
    "device_init_s",
    "load_s",
    "reserve_s",
    "capture_decode_s",
    "capture_piecewise_s",
    "capture_s",
    "activation_peak_s",
    "total_s",
}


@pytest.fixture(scope="module")
def startup_check() -> ModuleType:
    """The script as a module (it is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("startup_check", ROOT / "scripts" / "startup_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["startup_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def summed(phases: dict[str, float], keys: tuple[str, ...]) -> float:
    return sum(phases[key] for key in keys)


def test_the_breakdown_adds_up_to_the_total_and_splits_the_imports(startup_check) -> None:
    timings = {
        "process_age_s": 1.5,
        "device_init_s": 0.5,
        "load_s": 2.0,
        "reserve_s": 0.1,
        "capture_decode_s": 1.0,
        "capture_piecewise_s": 2.0,
        "capture_s": 3.2,
        "activation_peak_s": 0.3,
        "sizing_ms": 20.0,
        "total_s": 6.5,
    }
    phases = startup_check.breakdown(total_s=12.0, engine_start_s=4.0, timings=timings)
    assert phases["imports_s"] == 4.0 and phases["engine_imports_s"] == 1.5
    assert phases["server_imports_s"] == 2.5
    assert phases["sizing_s"] == pytest.approx(0.32)
    assert phases["engine_rest_s"] == pytest.approx(6.5 - 0.5 - 2.0 - 0.1 - 3.2 - 0.32)
    assert phases["after_engine_s"] == pytest.approx(12.0 - 4.0 - 6.5)
    assert summed(phases, startup_check.SUMMED) + phases["rest_s"] == pytest.approx(12.0)
    assert phases["rest_s"] == pytest.approx(phases["engine_rest_s"] + phases["after_engine_s"])


@pytest.mark.slow  # a real server process
def test_a_tiny_shape_starts_serves_and_stops_with_every_phase_within_the_total(
    startup_check, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shape = tmp_path / "tiny"
    shape.mkdir()
    write_tiny_llama_config(shape, context_length=256, vocab_size=512)
    out = tmp_path / "out"
    serve_flags = "--device cpu --host-kv-gib 0.02 --max-running-requests 4"
    code = startup_check.main(
        ["--out", str(out), "--shapes", str(shape), "--extra-args", serve_flags, "--timeout", "120"]
    )
    report = json.loads((out / "startup.json").read_text())
    (result,) = report["shapes"]
    assert code == 0 and report["ok"], result.get("error")

    phases = result["phases"]
    assert set(phases) == {key for key, _ in startup_check.ROWS}
    assert set(result["engine_timings"]) >= ENGINE_PHASES
    total = phases["total_s"]
    rounding = 1e-3 * len(startup_check.SUMMED)  # each phase is rounded to ms on its own
    assert 0 < summed(phases, startup_check.SUMMED) <= total + rounding
    assert phases["imports_s"] > 0 and phases["load_s"] > 0
    assert phases["engine_imports_s"] > 0  # the engine ran in a process of its own
    for part in ("rest_s", "engine_rest_s", "after_engine_s", "server_imports_s"):
        assert phases[part] >= -rounding, (part, phases)
    assert phases["capture_decode_s"] + phases["capture_piecewise_s"] <= phases["capture_s"] + rounding
    assert result["engine_timings"]["total_s"] < total

    assert result["request"]["status"] == 200 and result["request"]["completion_tokens"] == 8
    assert result["stop"] == {"exit_code": 0, "seconds": result["stop"]["seconds"]}
    log = Path(result["log"]).read_text()
    # the phases before the engine's first line and up to serving say their seconds in the log too
    assert re.search(r"Starting the engine: .* \(this process started \d+\.\d s ago: its imports\)", log)
    assert re.search(
        r"snugkv is serving on \S+ \(Ctrl-C to stop\), \d+\.\d s after this process started", log
    )
    printed = capsys.readouterr().out
    for _, label in startup_check.ROWS:
        assert label in printed
    assert "tiny: ok" in printed


def test_the_kernels_triton_compiled_are_counted_by_name(startup_check, tmp_path: Path) -> None:
    # Triton's cache: a folder per compiled specialization, its metadata named after the kernel
    for folder, name in (("a1", "_decode_kernel"), ("b2", "_decode_kernel"), ("c3", "_rmsnorm")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"{name}.json").write_text("{}")
        (tmp_path / folder / f"__grp__{name}.json").write_text("{}")
        (tmp_path / folder / f"{name}.cubin").write_bytes(b"")
    compiled = startup_check.triton_compiled(tmp_path)
    assert compiled == {"kernels": 3, "by_name": {"_decode_kernel": 2, "_rmsnorm": 1}}
    assert startup_check.triton_compiled(tmp_path / "none") == {"kernels": 0, "by_name": {}}


def test_the_py_spy_summary_splits_stacks_by_process_and_thread(tmp_path: Path, capsys) -> None:
    """A spawned child's command line holds ';' (its `-c` code): the stack still splits after it."""
    spec = importlib.util.spec_from_file_location("py_spy_summary", ROOT / "scripts" / "py_spy_summary.py")
    assert spec is not None and spec.loader is not None
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    server = 'process 10:"python -m snugkv serve --model m"'
    engine = 'process 11:"python -B -c from multiprocessing.spawn import spawn_main; spawn_main(fd=5)"'
    recording = tmp_path / "rec.txt"
    recording.write_text(
        f"{server};thread (10): MainThread;main (snugkv/cli.py:120) 30\n"
        f"{server};{engine};thread (12): snugkv-scheduler;build (snugkv/driver/engine_core.py:193);"
        "capture (snugkv/engine/capture.py:58) 70\n"
        f"{server};{engine};thread (12): snugkv-scheduler;build (snugkv/driver/engine_core.py:193) 20\n"
    )
    threads = summary.parse(recording)
    assert set(threads) == {
        ("10 -m snugkv serve", "thread (10): MainThread"),
        ("11 multiprocessing.spawn", "thread (12): snugkv-scheduler"),
    }
    assert summary.main([str(recording), "--match", "snugkv", "--min-seconds", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "== 11 multiprocessing.spawn | thread (12): snugkv-scheduler: 0.90 s" in out
    assert "0.90 s  build (snugkv/driver/engine_core.py:193)" in out
    assert "0.70 s  capture (snugkv/engine/capture.py:58)" in out
    assert "0.30 s" in out and "main (snugkv/cli.py:120)" in out
