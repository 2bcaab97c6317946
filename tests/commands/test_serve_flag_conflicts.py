"""`snugkv serve --kv-elastic` and `--engine-process` refuse the flags they cannot run with (yet), in
one line, before loading anything."""

from __future__ import annotations

import logging

import pytest

from snugkv.cli import main


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-elastic", "--tp", "2"], "does not run with --tp yet"),
        (["--kv-elastic", "--kv-sizing", "profiled"], "needs --kv-sizing post-capture"),
        (["--kv-elastic", "--kv-min-tokens", "1"], "--kv-min-tokens 1 is too small"),
        (
            ["--engine-process", "--tp", "2"],
            "--engine-process runs one engine in one process; it does not run with --tp yet",
        ),
        (["--engine-process", "--kv-elastic"], "--engine-process does not run with --kv-elastic yet"),
    ],
)
def test_serve_refuses_flags_that_cannot_run_together(
    flags: list[str], message: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        assert main(["serve", "--device", "cpu", "--port", "0", *flags]) == 2
    assert message in caplog.text


@pytest.mark.parametrize("weight", ["0", "-1", "inf", "lots"])
def test_memory_share_must_be_a_positive_weight(weight: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--kv-elastic", "--memory-share", weight])
    assert exit_info.value.code == 2
    assert "--memory-share" in capsys.readouterr().err
