"""`snugkv generate --tp 2` and `snugkv chat --tp 2` on CPU, as a user runs them: rank 0 owns the
terminal (a prompt from stdin, chat turns) and the other rank follows it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.models.hf_tiny import hf_greedy

# End to end (make test-fast leaves it out): the commands as two-rank processes.
pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]


def snugkv(*args: str, stdin: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "snugkv", *args, "--tp", "2", "--device", "cpu"]
    return subprocess.run(command, input=stdin, capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)


def test_generate_reads_the_prompt_from_stdin_once_and_prints_the_greedy_tokens(tiny_model):
    path, model, tokenizer = tiny_model
    prompt = "Stdin reaches rank 0 only"
    done = snugkv("generate", "--model", str(path), "--max-tokens", "9", "--ignore-eos", "-", stdin=prompt)
    assert done.returncode == 0, done.stderr
    expected = tokenizer.decode(hf_greedy(model, tokenizer.encode(prompt), 9))
    assert done.stdout == expected + "\n", (done.stdout, expected)


def test_chat_turns_typed_on_rank_0_run_on_both_ranks(tiny_model):
    path, model, tokenizer = tiny_model
    turns = ["hello there", "/reset", "second turn"]
    done = snugkv(
        "chat",
        "--model",
        str(path),
        "--max-tokens",
        "6",
        "--ignore-eos",
        stdin="\n".join(turns) + "\n/quit\n",
    )
    assert done.returncode == 0, done.stderr
    expected = []  # stdin is no terminal: no prompts, each answer one line; /reset: one turn each
    for turn in ["hello there", "second turn"]:
        prompt = tokenizer.encode_chat([{"role": "user", "content": turn}])
        expected.append(tokenizer.decode(hf_greedy(model, prompt, 6)) + "\n")
    assert done.stdout == "".join(expected), done.stdout


def test_a_model_that_does_not_split_is_refused_in_one_line_per_rank(tmp_path):
    # SmolLM2 (the default model) has 9 query heads: they cannot be split over two ranks.
    done = snugkv("serve", "--port", "0", stdin="")
    assert done.returncode == 2, done.stderr
    assert "error: num_attention_heads=9 cannot be split evenly over --tp 2" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_a_path_that_is_not_a_model_is_refused_by_serve_without_a_traceback(tmp_path):
    done = snugkv("serve", "--model", str(tmp_path / "missing"), "--port", "0", stdin="")
    assert done.returncode == 2
    assert "no such file or directory" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_taken_port_is_refused_before_the_engine_starts(tiny_model):
    import socket

    path, _, _ = tiny_model
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = snugkv("serve", "--model", str(path), "--port", str(port), stdin="")
    assert done.returncode == 2
    assert "choose another --port" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "Loaded" not in done.stderr  # refused before any rank loaded the model


def test_a_chat_left_idle_longer_than_the_collectives_timeout_goes_on(tiny_model):
    """The helper rank waits for the next turn without the timeout that guards collectives."""
    import os
    import time

    from tests.commands.test_chat_command import read_until

    path, _, _ = tiny_model
    command = [sys.executable, "-m", "snugkv", "chat", "--model", str(path), "--max-tokens", "4"]
    command += ["--tp", "2", "--device", "cpu"]
    env = {**os.environ, "SNUGKV_TP_TIMEOUT_S": "3"}
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        process.stdin.write(b"first\n")
        process.stdin.flush()
        # stdin is no terminal: no prompts, each answer one line
        seen = read_until(process, "\n", "")  # the first answer is done
        time.sleep(8)  # waiting for the next turn, well past the 3 s timeout
        out, err = process.communicate(b"second\n/quit\n", timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err.decode()
    assert len((seen + out.decode()).splitlines()) == 2, (seen, out)


def test_memory_sizes_every_rank_and_prints_one_line_per_rank(tiny_model):
    path, _, _ = tiny_model
    done = snugkv("memory", "--model", str(path), "--max-total-tokens", "1024", stdin="")
    assert done.returncode == 0, done.stderr
    assert "max_total_num_tokens=1,024" in done.stdout and "Memory ledger" in done.stdout
    assert [line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("rank ")] == [
        "rank 0",
        "rank 1",
    ]
