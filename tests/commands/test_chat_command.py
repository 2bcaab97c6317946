"""`snugkv chat` in a real process, as a person uses it (stdin a terminal): Ctrl-C while an answer
streams stops that answer and the chat goes on; /quit ends it with exit code 0. With stdin a pipe,
each line is a turn and each answer a line of its own, with no prompts."""

from __future__ import annotations

import os
import pty
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
    terminal, stdin = pty.openpty()
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    os.close(stdin)
    try:
        os.write(terminal, b"Count from one to a thousand.\n")
        stop_the_answer(process)
        os.write(terminal, b"Say hi.\n/quit\n")
        stop_the_answer(process)  # the chat went on: a second answer (with --ignore-eos, 2000 tokens)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        os.close(terminal)


@pytest.mark.slow
def test_with_stdin_a_pipe_each_line_is_a_turn_and_each_answer_a_line_without_prompts():
    command = [sys.executable, "-m", "snugkv", "chat", "--max-tokens", "6", "--ignore-eos"]
    done = subprocess.run(
        command,
        cwd=REPO_ROOT,
        input="Say hi.\n/reset\nSay bye.\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    answers = done.stdout.split("\n")
    assert len(answers) == 3 and answers[2] == "", done.stdout  # two answers, each ending its line
    assert all(answer.strip() and "you>" not in answer and "model>" not in answer for answer in answers[:2])
    assert "/reset starts over" not in done.stderr  # the help for a person at a terminal
