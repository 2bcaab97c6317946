"""A real `snugkv serve` with the engine in its own process (the default; the embedded model on
the CPU): completions and chat, streamed and not, a bad request that loses nothing else, the info
and metrics routes read across the process boundary, and Ctrl-C that stops both processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

# End to end (make test-fast leaves it out): real servers with their engine processes.
pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVING = re.compile(r"snugkv is serving on (http://\S+)")
START_TIMEOUT_S = 180.0


def start_server(log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    command = [
        sys.executable, "-m", "snugkv", "serve", "--device", "cpu", "--port", "0",  # --engine-process: the default
        "--max-running-requests", "8", "--host-kv-gib", "0.25",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    url = None
    while url is None and time.monotonic() < deadline:
        match = SERVING.search(log_path.read_text(errors="replace"))
        if match:
            url = match.group(1)
        elif process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}:\n{log_path.read_text()}")
        else:
            time.sleep(0.2)
    assert url is not None, f"the server did not start:\n{log_path.read_text()}"
    return process, url


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    log_path = tmp_path_factory.mktemp("engine-process") / "server.log"
    process, url = start_server(log_path)
    yield process, url, log_path
    if process.poll() is None:
        process.kill()
        process.wait(timeout=30)


def completion(url: str, **fields: object) -> httpx.Response:
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0, **fields}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def streamed_text(url: str) -> str:
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0, "stream": True}
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[len("data: ") :])["choices"][0]["text"]
    return text


def test_completions_and_chat_stream_and_not_through_the_engine_process(server):
    _, url, _ = server
    plain = completion(url)
    assert plain.status_code == 200, plain.text
    usage = plain.json()["usage"]
    assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] > 0
    text = plain.json()["choices"][0]["text"]
    assert text and streamed_text(url) == text  # greedy: the same tokens either way
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0.0},
        timeout=120,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 4


def test_a_bad_request_is_a_400_and_the_server_goes_on(server):
    _, url, _ = server
    too_long = completion(url, max_tokens=10**7)
    assert too_long.status_code == 400 and "max_tokens" in too_long.json()["error"]["message"]
    assert completion(url).status_code == 200


def test_info_metrics_and_kv_are_read_from_the_engine_process(server):
    process, url, _ = server
    info = httpx.get(f"{url}/server_info", timeout=30).json()
    engine_pid = info["engine_process"]["pid"]
    assert engine_pid != process.pid
    os.kill(engine_pid, 0)  # alive
    assert info["max_total_num_tokens"] > 0 and info["stats"]["num_running_requests"] == 0
    assert info["model"] == info["served_model_name"]
    assert httpx.get(f"{url}/health", timeout=30).json() == {"status": "ok"}
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert f"snugkv_kv_max_total_num_tokens {float(info['kv_capacity_tokens'])}" in metrics
    kv = httpx.get(f"{url}/kv", timeout=30).json()
    assert kv["max_total_num_tokens"] == info["max_total_num_tokens"]


def test_a_profile_of_the_engines_steps_is_taken_through_the_server(server, tmp_path):
    """POST /start_profile records the engine process's next steps; /stop_profile writes the trace
    under the server's profile folder and says where the time went (on CPU: the host's ops); a
    stop with nothing to take or a start while one runs is a 409, a bad field or a folder outside
    the profile folder a 400, and serving goes on."""
    _, url, _ = server
    assert httpx.post(f"{url}/stop_profile", timeout=30).status_code == 409
    assert httpx.post(f"{url}/start_profile", json={"num_steps": "ten"}, timeout=30).status_code == 400
    # a client names a folder under the server's profile folder, never a path elsewhere
    refused = httpx.post(f"{url}/start_profile", json={"output_dir": str(tmp_path)}, timeout=30)
    assert refused.status_code == 400 and "inside the profile folder" in refused.text
    folder = f"test-{os.getpid()}"
    started = httpx.post(f"{url}/start_profile", json={"output_dir": folder}, timeout=30)
    assert started.status_code == 200 and started.json()["output_dir"].endswith(folder)
    assert httpx.post(f"{url}/start_profile", timeout=30).status_code == 409  # one at a time
    assert completion(url).status_code == 200
    report = httpx.post(f"{url}/stop_profile", timeout=60).json()
    trace = Path(report["trace_path"])
    assert report["steps"] >= 8 and trace.parent.name == folder and trace.is_file()
    summary = report["summary"]
    assert summary["device"] is False and summary["total_us"] > 0 and summary["kinds"].get("gemm", 0) > 0
    assert httpx.post(f"{url}/stop_profile", timeout=30).status_code == 409  # taken already
    # the steps to record can be counted: the profile ends by itself, its report waits for a stop
    body = {"num_steps": 2, "output_dir": folder}
    assert httpx.post(f"{url}/start_profile", json=body, timeout=30).status_code == 200
    assert completion(url).status_code == 200
    second = httpx.post(f"{url}/stop_profile", timeout=60).json()
    assert second["steps"] == 2 and second["trace_path"] != report["trace_path"]
    assert completion(url).status_code == 200
    shutil.rmtree(trace.parent)


def test_ctrl_c_stops_the_server_and_its_engine_process(server):
    process, url, log_path = server
    engine_pid = httpx.get(f"{url}/server_info", timeout=30).json()["engine_process"]["pid"]
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=120) == 0, log_path.read_text()
    log = log_path.read_text()
    assert "did not stop" not in log and "exited unexpectedly" not in log, log
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(engine_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the engine process {engine_pid} outlived the server:\n{log_path.read_text()}")


def test_a_dead_engine_process_stops_the_server_with_an_error_exit(tmp_path):
    log_path = tmp_path / "server.log"
    process, url = start_server(log_path)
    try:
        engine_pid = httpx.get(f"{url}/server_info", timeout=30).json()["engine_process"]["pid"]
        os.kill(engine_pid, signal.SIGKILL)
        assert process.wait(timeout=120) == 1, log_path.read_text()  # a supervisor restarts it
        assert "The engine process exited unexpectedly (code -9)" in log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
