"""`snugkv serve --kv-elastic` refuses flags it cannot run with, in one line, before loading anything."""

from __future__ import annotations

import logging

import pytest

from snugkv.cli import main


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tp", "2"], "does not run with --tp yet"),
        (["--kv-sizing", "profiled"], "needs --kv-sizing post-capture"),
        (["--kv-min-tokens", "1"], "--kv-min-tokens 1 is too small"),
    ],
)
def test_kv_elastic_refuses_what_it_cannot_share_with(
    flags: list[str], message: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        assert main(["serve", "--device", "cpu", "--port", "0", "--kv-elastic", *flags]) == 2
    assert message in caplog.text


@pytest.mark.parametrize("weight", ["0", "-1", "inf", "lots"])
def test_memory_share_must_be_a_positive_weight(weight: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--kv-elastic", "--memory-share", weight])
    assert exit_info.value.code == 2
    assert "--memory-share" in capsys.readouterr().err
