"""`snugkv serve --tp 2` on CPU: a real server process whose two gloo ranks step in lockstep.

The model is a tiny random Llama saved with SmolLM2's tokenizer, so requests go in as text and
come back as text; greedy answers must be the tokens transformers picks for the same weights.
Aborted streams, refused requests and Ctrl-C must leave both ranks in step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from tests.models.hf_tiny import hf_greedy
from tests.server.expect import openai_error

# End to end (make test-fast leaves it out): a two-rank server process.
pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVING = "snugkv is serving on "
NEW_TOKENS = 10
PROMPTS = ["The capital of France is", "One, two, three,", "def add(a, b):", "Once upon a time"]


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (nvidia-h200-x2)")


def start_tp_server(model_path: Path, device: str, log_path: Path) -> tuple[str, subprocess.Popen]:
    """`snugkv serve --tp 2` in its own process group; returns (base URL, process) once it serves."""
    command = [
        sys.executable, "-m", "snugkv", "serve", "--model", str(model_path), "--tp", "2", "--device", device,
        "--dtype", "float32", "--port", "0", "--max-total-tokens", "2048", "--max-running-requests", "8",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert process.poll() is None, log_path.read_text()
        for line in log_path.read_text(errors="replace").splitlines():
            if SERVING in line:
                return line.split(SERVING)[1].split()[0], process
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"the server did not start:\n{log_path.read_text()}")


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, TWO_GPUS])])
def server(request, tiny_model, tmp_path_factory):
    path, _, _ = tiny_model
    log_path = tmp_path_factory.mktemp("serve-tp") / "server.log"
    base_url, process = start_tp_server(path, request.param, log_path)
    yield base_url, process, log_path
    if process.poll() is None:
        process.kill()
        process.wait()


def complete(http: httpx.Client, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_two_ranks_serve_the_greedy_tokens_of_transformers(server, tiny_model):
    base_url, _, log_path = server
    _, model, tokenizer = tiny_model
    with httpx.Client(base_url=base_url, timeout=120) as http, ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda prompt: complete(http, prompt), PROMPTS))
        info = http.get("/server_info").json()
    for prompt, result in zip(PROMPTS, results, strict=True):
        expected = hf_greedy(model, tokenizer.encode(prompt), NEW_TOKENS)
        assert result["choices"][0]["text"] == tokenizer.decode(expected), prompt
    assert info["tp_size"] == 2 and len(info["per_rank_free_bytes"]) == 2, info
    sizing = next(line for line in log_path.read_text().splitlines() if "KV sizing:" in line)
    assert f"max_total_num_tokens={info['max_total_num_tokens']}" in sizing  # rank 0 speaks for both
    assert "free per rank=[" in sizing, sizing


def test_aborts_and_refusals_keep_the_ranks_in_step(server, tiny_model):
    base_url, _, _ = server
    _, model, tokenizer = tiny_model
    with httpx.Client(base_url=base_url, timeout=120) as http:
        long_body = {"prompt": "tell", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=long_body) as stream:
            next(line for line in stream.iter_lines() if line.startswith("data: "))  # then hang up
        too_long = {"prompt": "word " * 400, "max_tokens": 4}
        assert "context" in openai_error(http.post("/v1/completions", json=too_long), 400)
        again = complete(http, PROMPTS[0])  # both ranks still agree on every step
        expected = hf_greedy(model, tokenizer.encode(PROMPTS[0]), NEW_TOKENS)
        assert again["choices"][0]["text"] == tokenizer.decode(expected)
        deadline = time.monotonic() + 30
        while True:
            accounting = http.get("/server_info").json()["slot_accounting_when_idle"]
            if (
                accounting.get("checked")
                and accounting["free_tokens"] + accounting["cached_tokens"] == (accounting["capacity_tokens"])
            ):
                break
            assert time.monotonic() < deadline, accounting
            time.sleep(0.2)
        assert accounting["ok"], accounting


def test_a_stop_signal_to_the_whole_process_group_stops_every_rank_cleanly(server):
    base_url, process, log_path = server
    assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200
    # As systemd, `timeout` or `kill -- -PGID` do (a terminal's Ctrl-C also goes to the whole
    # group): only rank 0 may act on it, and it tells the helper rank to stop.
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(timeout=60) == 0, log_path.read_text()
    log = log_path.read_text()
    assert "Traceback" not in log, log


def helper_ranks(process: subprocess.Popen) -> list[int]:
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    return [int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def test_a_dead_helper_rank_fails_in_flight_requests_and_the_server_exits_non_zero(tiny_model, tmp_path):
    """A supervisor restarts a server that exits; one that answers 503 forever it never restarts."""
    path, _, _ = tiny_model
    log_path = tmp_path / "server.log"
    base_url, process = start_tp_server(path, "cpu", log_path)
    try:
        lines: list[str] = []
        body = {"prompt": "tell", "max_tokens": 240, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(base_url=base_url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=body) as stream,
        ):
            for line in stream.iter_lines():
                if line.startswith("data: ") and not lines:
                    (helper,) = helper_ranks(process)
                    os.kill(helper, signal.SIGKILL)
                lines.append(line)
        assert process.wait(timeout=90) != 0, log_path.read_text()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    events = [line for line in lines if line.startswith("data: ")]
    assert '"error"' in events[-2] and events[-1] == "data: [DONE]", events[-3:]
    log = log_path.read_text()
    assert "Stopped serving on" in log, log  # a graceful stop, not the watchdog's exit
    assert log.rstrip().splitlines()[-1].startswith("error: a tensor-parallel helper rank failed"), log
