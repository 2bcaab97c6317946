"""A mistake a user fixes by changing a flag or a file is one `error:` line naming it, exit code 2,
never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from snugkv.cli import main
from snugkv.models.default_model import default_model_path
from tests.models.hf_tiny import tiny_hf_config

REPO_ROOT = Path(__file__).resolve().parents[2]


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Runs `snugkv ARGV` in this process; returns its one error line (exit code 2 checked)."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse
        code = exc.code
    assert code == 2
    return one_error_line(capsys)


@pytest.fixture(scope="module")
def truncated_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The default model cut inside its metadata (1 MB) and inside its tensor data (50 MB)."""
    whole = default_model_path().read_bytes()
    folder = tmp_path_factory.mktemp("truncated")
    files = {}
    for name, size in (("1mb", 1_000_000), ("50mb", 50_000_000)):
        files[name] = folder / f"{name}.gguf"
        files[name].write_bytes(whole[:size])
    return files


@pytest.mark.parametrize("cut", ["1mb", "50mb"])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_truncated_gguf_says_the_file_ends_early(capsys, truncated_ggufs, command, cut):
    argv = [command, "--model", str(truncated_ggufs[cut]), *(["hi"] if command == "generate" else [])]
    line = run_cli(capsys, *argv)
    assert "ends early" in line and "is the file complete?" in line


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_tp_below_one_names_the_flag(capsys, value):
    assert "argument --tp:" in run_cli(capsys, "generate", "--tp", value, "hi")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only machine")
def test_device_cuda_without_cuda_names_the_flag(capsys):
    line = run_cli(capsys, "generate", "--device", "cuda", "hi")
    assert "argument --device:" in line and "--device cpu" in line


@pytest.mark.parametrize("device", ["tpu", "mps", "cuda:99"])
def test_a_device_snugkv_cannot_use_names_the_flag(capsys, device):
    assert "argument --device:" in run_cli(capsys, "memory", "--device", device)


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_port_out_of_range_names_the_flag(capsys, port):
    assert "argument --port:" in run_cli(capsys, "serve", "--port", port)


def test_a_host_that_is_not_an_address_names_host_not_port(capsys):
    line = run_cli(capsys, "serve", "--host", "999.1.1.1", "--port", "0")
    assert "--host" in line and "--port" not in line


def test_log_level_is_accepted_after_the_subcommand_too(capsys):
    line = run_cli(capsys, "generate", "hi", "--log-level", "warning", "--temperature", "-1")
    assert "temperature" in line
    assert "argument --log-level:" in run_cli(capsys, "--log-level", "loud", "memory")


def test_an_out_of_memory_while_loading_weights_says_what_holds_the_gpu(capsys, monkeypatch, tmp_path):
    """Simulated: the second engine on a GPU that another one fills runs out while loading weights."""
    from snugkv.models import loader

    def no_room(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    gib = 1 << 30
    monkeypatch.setattr(loader, "build_model", no_room)
    monkeypatch.setattr(loader, "device_memory_bytes", lambda device: (1 * gib, 140 * gib, 0))
    tiny_hf_config("llama").save_pretrained(tmp_path)
    config = str(tmp_path / "config.json")
    line = run_cli(capsys, "memory", "--model", config, "--load-format", "dummy", "--device", "cpu")
    assert "need about" in line and "has 1.00 of its 140.00 GiB free" in line
    assert "other processes hold about 139.00 GiB" in line and "--max-total-tokens" in line


def test_the_snugkv_command_prints_no_traceback_for_a_bad_flag():
    """The console entry point, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-m", "snugkv", "serve", "--port", "70000"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: argument --port:") and len(done.stderr.splitlines()) == 1


def test_a_mistyped_flag_names_the_commands_help_and_the_closest_flag_and_runs_nothing():
    """As a user types it: the value after the mistyped flag is not taken as the prompt."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-m", "snugkv", "generate", "--max-tokenz", "5", "hello"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "error: 'snugkv generate' has no flag --max-tokenz; did you mean --max-tokens? "
        "(see 'snugkv generate --help')\n"
    )


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["serve", "--max-running-requsts", "4"], "'snugkv serve' has no flag --max-running-requsts; did you mean --max-running-requests? (see 'snugkv serve --help')"),
        (["bench", "http", "--requestz=3"], "'snugkv bench http' has no flag --requestz; did you mean --requests? (see 'snugkv bench http --help')"),
        (["generate", "--no-such-thing", "hi"], "'snugkv generate' has no flag --no-such-thing (see 'snugkv generate --help')"),
        (["generate", "hi", "there"], "unrecognized arguments: there (see 'snugkv generate --help')"),
    ],
)  # fmt: skip
def test_an_unknown_flag_is_named_with_its_commands_help(capsys, argv, says):
    assert run_cli(capsys, *argv) == f"error: {says}"
