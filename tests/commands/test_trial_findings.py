"""What a trial as a new user found (issue 26, item 7), each pinned: engine flags refused in one line
by every command before anything loads, flags that do nothing without their mode, an empty API key,
Ctrl-C, `memory --json`, `chat --help`, `--version`, and no message naming a flag that does not exist."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import snugkv
from snugkv.cli import build_parser, main
from tests.commands.test_serve_command import started  # noqa: F401  (the recorder fixture)
from tests.commands.test_user_mistakes import run_cli

REPO_ROOT = Path(__file__).resolve().parents[2]
SRC = REPO_ROOT / "src" / "snugkv"

BAD_ENGINE_FLAGS = [
    (["--dtype", "foo"], "--dtype must be one of"),
    (["--kv-dtype", "foo"], "--kv-dtype must be one of"),
    (
        ["--gpu-memory-utilization", "1.5", "--kv-sizing", "profiled"],
        "--gpu-memory-utilization must be in (0, 1]",
    ),
    (["--context-length", "-5"], "--context-length must be a positive number of tokens"),
    (["--context-length", "0"], "--context-length must be a positive number of tokens"),
    (["--chunked-prefill-size", "-1"], "--chunked-prefill-size must be a positive number of tokens"),
    (["--attention-backend", "triton", "--device", "cpu"], "--attention-backend triton runs on a CUDA GPU"),
    (["--swa-full-tokens-ratio", "2"], "--swa-full-tokens-ratio must be in (0, 1]"),
]


@pytest.mark.parametrize(("flags", "message"), BAD_ENGINE_FLAGS)
@pytest.mark.parametrize("command", [["generate", "hi"], ["serve", "--port", "0"], ["memory"], ["chat"]])
def test_a_bad_engine_flag_is_one_line_from_every_command_before_loading(
    capsys, monkeypatch, command, flags, message
):
    from snugkv.engine import pipeline  # imported first, so it keeps the real load_model after the test
    from snugkv.models import loader

    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was read before the flags were checked")

    for module in (loader, pipeline):
        monkeypatch.setattr(module, "load_model", no_loading)
    monkeypatch.setattr(loader, "read_model_config", no_loading)
    assert message in run_cli(capsys, *command, *flags)


@pytest.mark.parametrize(("flags", "message"), BAD_ENGINE_FLAGS)
def test_llm_refuses_the_same_flags_with_invalid_engine_args(flags, message):
    from snugkv import LLM
    from snugkv.engine import InvalidEngineArgs

    options = {}
    for index in range(0, len(flags), 2):
        value: object = flags[index + 1]
        with_type = {"--gpu-memory-utilization": float, "--swa-full-tokens-ratio": float}
        if flags[index] in ("--context-length", "--chunked-prefill-size"):
            value = int(flags[index + 1])
        elif flags[index] in with_type:
            value = with_type[flags[index]](flags[index + 1])
        options[flags[index][2:].replace("-", "_")] = value
    with pytest.raises(InvalidEngineArgs, match=re.escape(message)):
        LLM(**options)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization 0.5 is ignored"),
        (
            ["--gpu-memory-utilization", "0.5", "--kv-sizing", "post-capture"],
            "applies only with --kv-sizing profiled",
        ),
        (["--mem-fraction-static", "0.5"], "--mem-fraction-static 0.5 is ignored"),
    ],
)
def test_a_sizing_flag_its_mode_ignores_is_warned_about_in_one_line(started, caplog, flags, message):  # noqa: F811
    with caplog.at_level(logging.WARNING, logger="snugkv.commands.engine_args"):
        assert main(["serve", "--port", "0", *flags]) == 0
    warnings = [r for r in caplog.records if r.name == "snugkv.commands.engine_args"]
    assert len(warnings) == 1 and message in warnings[0].getMessage()


def test_a_sizing_flag_in_its_mode_is_not_warned_about(started, caplog):  # noqa: F811
    with caplog.at_level(logging.WARNING, logger="snugkv.commands.engine_args"):
        assert (
            main(["serve", "--port", "0", "--kv-sizing", "profiled", "--gpu-memory-utilization", "0.5"]) == 0
        )
    assert not [r for r in caplog.records if r.name == "snugkv.commands.engine_args"]


@pytest.mark.parametrize("flag", [["--kv-min-tokens", "4096"], ["--memory-share", "2"]])
def test_a_kv_elastic_flag_without_kv_elastic_is_refused(started, caplog, flag):  # noqa: F811
    with caplog.at_level(logging.ERROR):
        assert main(["serve", "--port", "0", *flag]) == 2
    assert f"{flag[0]} applies only with --kv-elastic" in caplog.text


def test_kv_elastic_flags_keep_their_defaults(monkeypatch):
    from snugkv.commands import serve

    args = build_parser().parse_args(["serve", "--kv-elastic"])
    assert serve._share_flags_problem(args) is None
    assert (args.kv_min_tokens, args.memory_share) == (
        serve.DEFAULT_KV_MIN_TOKENS,
        serve.DEFAULT_MEMORY_SHARE,
    )


@pytest.mark.parametrize("source", ["flag", "environment"])
def test_an_empty_api_key_is_refused_not_taken_as_no_key(started, caplog, monkeypatch, source):  # noqa: F811
    argv = ["serve", "--port", "0"]
    if source == "flag":
        argv += ["--api-key", ""]
    else:
        monkeypatch.setenv("SNUGKV_API_KEY", "  ")
    with caplog.at_level(logging.ERROR):
        assert main(argv) == 2
    assert "is empty, which would turn authentication off" in caplog.text
    assert "api_key" not in started  # nothing was served


def test_max_body_bytes_zero_is_refused(capsys):
    assert "argument --max-body-bytes:" in run_cli(capsys, "serve", "--max-body-bytes", "0")


def test_a_context_beyond_the_models_positions_is_warned_about(caplog, tmp_path):
    from snugkv.models.loader import load_model
    from tests.models.hf_tiny import tiny_hf_config

    config = tiny_hf_config("llama")
    config.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="snugkv.models.loader"):
        load_model(str(tmp_path / "config.json"), load_format="dummy", device="cpu",
                   max_position=config.max_position_embeddings * 4)  # fmt: skip
    assert f"beyond the {config.max_position_embeddings} positions" in caplog.text


def test_snugkv_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"snugkv {snugkv.__version__}"


def test_chat_help_shows_the_max_tokens_default_that_applies(capsys):
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "new tokens at most (default: 512)" in text
    assert build_parser().parse_args(["chat"]).max_tokens == 512


def test_memory_json_prints_only_json_on_stdout(capsys, tmp_path):
    from tests.models.hf_tiny import tiny_hf_config

    tiny_hf_config("llama").save_pretrained(tmp_path)
    config = str(tmp_path / "config.json")
    assert main(["memory", "--model", config, "--load-format", "dummy", "--device", "cpu", "--json",
                 "--max-total-tokens", "256"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert report["max_total_num_tokens"] == 256


def _flags_named_in_messages() -> dict[str, set[str]]:
    """Every `--flag` that a sentence in the package names (an error, a log line, a help text), with
    the files that name it; a string that is one word is another program's argument, not a message."""
    named: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and " " in node.value.strip():
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*", node.value):
                    named.setdefault(flag, set()).add(str(path.relative_to(SRC)))
    return named


def _every_flag() -> set[str]:
    flags: set[str] = set()
    parsers = [build_parser()]
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            flags.update(action.option_strings)
            if hasattr(action, "choices") and isinstance(action.choices, dict):
                parsers.extend(p for p in action.choices.values() if hasattr(p, "_actions"))
    from snugkv.commands.bench import BENCHMARKS  # their arguments join their parser when they run

    for module_name in BENCHMARKS.values():
        bench_parser = argparse.ArgumentParser()
        importlib.import_module(module_name).add_arguments(bench_parser)
        flags.update(option for action in bench_parser._actions for option in action.option_strings)
    from snugkv.bench import soak_hog  # a program of its own, run by bench soak

    flags.update(option for action in soak_hog.build_parser()._actions for option in action.option_strings)
    flags.update("--no-" + f[2:] for f in list(flags))  # BooleanOptionalAction's negations
    return flags


OTHER_PROGRAMS_FLAGS = {"--no-deps"}  # pip's, in a docstring
OTHER_PROGRAMS_FLAGS |= {"--worker-urls"}  # smg's, in the --dp refusal that points to it
OTHER_PROGRAMS_FLAGS |= {"--profiler-config"}  # vLLM's, which bench peers starts it with to profile it
OTHER_PROGRAMS_FILES = {"server/router.py"}  # builds and documents smg's command line, not snugkv's


def test_every_flag_a_message_names_exists():
    missing = {
        flag: files
        for flag, files in _flags_named_in_messages().items()
        if flag not in _every_flag() and flag not in OTHER_PROGRAMS_FLAGS and files - OTHER_PROGRAMS_FILES
    }
    assert not missing, missing


@pytest.mark.parametrize("when", ["starting", "generating"])
def test_ctrl_c_prints_one_line_not_a_traceback(when):
    """As a person presses Ctrl-C: SIGINT to the command (its own default handler, not a
    background job's ignored one), while the model loads or while the answer streams."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    argv = [sys.executable, "-m", "snugkv", "generate", "Count to a thousand:", "--ignore-eos",
            "--max-tokens", "100000", "--context-length", "100100"]  # fmt: skip
    process = subprocess.Popen(
        argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    if when == "generating":
        process.stdout.read(1)  # the first streamed character
    else:
        process.stderr.readline()  # the first log line: the engine is starting
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.rstrip().endswith("stopped (Ctrl-C)")
