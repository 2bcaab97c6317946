"""A real server process on 127.0.0.1 for the server tests, started once per session.

The engine behind it is chosen by SNUGKV_TEST_ENGINE (`real` by default: SmolLM2 on CPU; see
`serve_for_tests.build_engine`). Tests talk to it only over HTTP.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.server.serve_for_tests import LISTENING, SHUTDOWN_COMPLETE

ENGINE = os.environ.get("SNUGKV_TEST_ENGINE", "real")
API_KEY = "snugkv-test-key"
MAX_BODY_BYTES = 256 * 1024
START_TIMEOUT_S = 120.0
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ServerProcess:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kwargs: object) -> httpx.Client:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        options: dict[str, object] = {"timeout": 30.0, **kwargs}
        return httpx.Client(base_url=self.base_url, headers=headers, **options)  # type: ignore[arg-type]

    def stop(self, timeout_s: float = 30.0) -> int:
        """Ctrl-C, as a person would; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(
    log_dir: Path, *extra_args: str, wait_until_healthy: bool = True, engine: str = ENGINE
) -> ServerProcess:
    """Starts the server; returns once it answers /health (or, if not waiting, once its socket is bound)."""
    log_path = log_dir / "server.log"
    command = [
        sys.executable, "-m", "tests.server.serve_for_tests",
        "--engine", engine, "--port", "0", "--api-key", API_KEY, "--max-body-bytes", str(MAX_BODY_BYTES),
        *extra_args,
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith(LISTENING):
                server = ServerProcess(line.split()[1], process, log_path)
                if wait_until_healthy:
                    _wait_until_healthy(server, deadline)
                return server
        if process.poll() is not None:
            raise RuntimeError(f"the test server exited with {process.returncode}:\n{log_path.read_text()}")
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"the test server did not start in {START_TIMEOUT_S} s:\n{log_path.read_text()}")


def _wait_until_healthy(server: ServerProcess, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{server.base_url}/health", timeout=5.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"the test server never became healthy:\n{server.log()}")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start_server(tmp_path_factory.mktemp("server"))
    yield process
    exit_code = process.stop()
    assert exit_code == 0, process.log()
    assert SHUTDOWN_COMPLETE in process.log()
    assert "Traceback" not in process.log(), process.log()


@pytest.fixture()
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client() as http:
        yield http


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects by mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that talks to the session's server process is end to end: `slow`, so that
    `make test-fast` leaves it (and the server's start) out; `make test` runs it."""
    for item in items:
        if "server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
