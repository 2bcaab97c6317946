"""`snugkv chat` in a real process, as a person uses it: Ctrl-C while an answer streams stops that
answer and the chat goes on; /quit ends it with exit code 0."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def read_until(process: subprocess.Popen, marker: str, seen: str, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    fd = process.stdout.fileno()
    while marker not in seen:
        assert time.monotonic() < deadline, f"no {marker!r} in {seen!r}"
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            chunk = os.read(fd, 4096).decode(errors="replace")
            assert chunk, f"chat exited early: {seen!r}"
            seen += chunk
    return seen


def stop_the_answer(process: subprocess.Popen) -> None:
    """Wait until an answer streams, press Ctrl-C, wait until the chat says it stopped."""
    answer = read_until(process, "model> ", "").split("model> ", 1)[1]
    read_until(process, " ", answer)  # some text of this answer has arrived
    process.send_signal(signal.SIGINT)
    read_until(process, "[stopped]", "")


@pytest.mark.slow
def test_ctrl_c_stops_the_answer_and_the_chat_goes_on():
    command = [sys.executable, "-m", "snugkv", "chat", "--max-tokens", "2000", "--ignore-eos"]
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        process.stdin.write(b"Count from one to a thousand.\n")
        process.stdin.flush()
        stop_the_answer(process)
        process.stdin.write(b"Say hi.\n/quit\n")
        process.stdin.flush()
        stop_the_answer(process)  # the chat went on: a second answer (with --ignore-eos, 2000 tokens)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
