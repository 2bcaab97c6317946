"""Start-up and shutdown: Ctrl-C stops a busy server cleanly and runs `on_shutdown`."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from snugkv.server.app import create_app
from snugkv.server.launch import serve
from snugkv.server.sockets import bind_socket
from tests.server.conftest import API_KEY, ServerProcess, start_server
from tests.server.fake_engine import FakeEngine
from tests.server.serve_for_tests import SHUTDOWN_COMPLETE

WATCHDOG_S = 15.0


@pytest.mark.slow
def test_ctrl_c_with_a_stream_in_flight_exits_zero_after_on_shutdown(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    streaming = threading.Event()
    lines: list[str] = []

    def stream() -> None:
        body = {"prompt": "busy", "max_tokens": 300, "ignore_eos": True, "stream": True}
        try:
            with server.client() as http, http.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    lines.append(line)
                    streaming.set()
        except httpx.HTTPError as exc:  # a stream cut at the graceful-shutdown deadline is fine
            lines.append(f"error: {exc}")
        finally:
            streaming.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert streaming.wait(timeout=30)
    exit_code = server.stop(timeout_s=30)
    reader.join(timeout=30)
    assert not reader.is_alive(), "the client hung after the server stopped"
    assert exit_code == 0, server.log()
    assert SHUTDOWN_COMPLETE in server.log()
    assert "Traceback" not in server.log(), server.log()
    assert "data: [DONE]" in lines or lines[-1].startswith("error"), lines[-3:]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_before_uvicorn_starts_still_stops_and_runs_on_shutdown(signum: int) -> None:
    app = create_app(FakeEngine(), api_key=None, max_body_bytes=1024, served_model_name="m")
    events: list[str] = []

    def on_listening(url: str) -> None:
        events.append("listening")
        signal.raise_signal(signum)  # lands before uvicorn installs its own handlers

    # If the early signal were lost the server would run on; a second one, which uvicorn does
    # catch, ends it so the test fails instead of hanging the suite.
    watchdog = threading.Timer(WATCHDOG_S, lambda: os.kill(os.getpid(), signal.SIGINT))
    watchdog.start()
    previous = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite runs as a background job
    started_s = time.monotonic()
    try:
        serve(
            app,
            port=0,
            on_listening=on_listening,
            on_shutdown=lambda: events.append("shutdown"),
            log_level="error",
        )
    finally:
        watchdog.cancel()
    assert time.monotonic() - started_s < WATCHDOG_S, "the signal before start-up was lost"
    assert events == ["listening", "shutdown"]
    assert signal.getsignal(signal.SIGINT) is previous, "the previous handler is back"


def test_a_busy_port_fails_with_a_message_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}.*choose another --port"):
            bind_socket("127.0.0.1", port)


def test_health_is_503_while_the_engine_is_unhealthy() -> None:
    engine = FakeEngine()
    app = create_app(engine, api_key=None, max_body_bytes=1024, served_model_name="m")
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        engine.healthy = False
        response = client.get("/health")
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "server_error"


def _address(server: ServerProcess) -> tuple[str, int]:
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def test_a_1_mb_request_header_gets_431_not_a_reset(server: ServerProcess) -> None:
    """Raw socket: the client sends all its headers before reading, as real clients do."""
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"
    with socket.create_connection(_address(server), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"request_header_fields_too_large" in answer
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


@pytest.mark.slow
def test_a_client_stalled_mid_body_at_shutdown_gets_503_and_no_traceback(tmp_path: Path) -> None:
    server = start_server(tmp_path, engine="fake")  # no engine work: the request never gets its body
    with socket.create_connection(_address(server), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"prompt": '
        )
        time.sleep(0.3)  # the server is waiting for the rest of the body
        exit_code = server.stop(timeout_s=30)
        answer = sock.recv(65536)
    assert exit_code == 0, server.log()
    assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
    assert b"server_shutting_down" in answer
    assert "Traceback" not in server.log() and "CancelledError" not in server.log(), server.log()
    assert SHUTDOWN_COMPLETE in server.log()


def test_a_connection_idle_longer_than_an_http_clients_expiry_still_serves(server: ServerProcess) -> None:
    """httpx (and so the OpenAI SDK) reuses a connection idle for up to 5 s: a server that closes
    idle connections at 5 s, as uvicorn does by default, races it, and the client sees its stream cut
    (one `ReadError` in a pressure bench at 7c5d0a1). The server keeps them longer."""
    import http.client
    from urllib.parse import urlsplit

    address = urlsplit(server.base_url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
    try:
        sockets = []
        for wait_s in (0.0, 6.0):
            time.sleep(wait_s)
            connection.request("GET", "/health")
            response = connection.getresponse()
            response.read()
            assert response.status == 200
            assert connection.sock is not None
            sockets.append(connection.sock.getsockname())
        assert sockets[0] == sockets[1]  # one connection served both: it was never reopened
    finally:
        connection.close()
