"""`snugkv serve --engine-process` refuses the flags it cannot run with yet, in one line, before
loading anything."""

from __future__ import annotations

import logging

import pytest

from snugkv.cli import main


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tp", "2"], "--engine-process runs one engine in one process; it does not run with --tp yet"),
        (["--kv-elastic"], "--engine-process does not run with --kv-elastic yet"),
    ],
)
def test_engine_process_refuses_what_it_cannot_run_with(
    flags: list[str], message: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        assert main(["serve", "--device", "cpu", "--port", "0", "--engine-process", *flags]) == 2
    assert message in caplog.text
