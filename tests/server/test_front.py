"""The front of `serve --dp` against stand-ins for smg and two replicas (small HTTP servers in this
process), so every way a request and its answer can pass is checked without a model: where each
request goes, the bytes that reach upstream, keep-alive and chunked answers on one client
connection, streams passed on as they come, a client that leaves, no replica ready, and a stop.
The whole fleet with the real smg is `test_replicas.py`'s."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from snugkv.server import front as front_module
from snugkv.server.front import Front, FrontOptions, is_token_id_prompt
from snugkv.server.sockets import bind_socket


@dataclass
class Upstream:
    """A stand-in for smg or a replica: it echoes what it got, reports a load, and streams."""

    name: str
    load: int = 0
    ready: bool = True
    disconnected: threading.Event = field(default_factory=threading.Event)
    port: int = 0
    server: uvicorn.Server | None = None

    def app(self) -> Starlette:
        async def echo(request: Request) -> Response:
            body = await request.body()
            asked = json.loads(body or b"{}") if request.url.path == "/v1/completions" else {}
            if asked.get("stream"):
                events = self._events(request, gap_s=asked.get("gap_s", 0.2))
                return StreamingResponse(events, media_type="text/event-stream")
            return JSONResponse(
                {
                    "served_by": self.name,
                    "method": request.method,
                    "target": request.url.path + (f"?{request.url.query}" if request.url.query else ""),
                    "headers": [[name.decode(), value.decode()] for name, value in request.headers.raw],
                    "body": body.decode(),
                }
            )

        async def loads(request: Request) -> Response:
            return JSONResponse({"loads": [{"num_total_reqs": self.load}]})

        async def ready(request: Request) -> Response:
            return JSONResponse({}, status_code=200 if self.ready else 503)

        async def forever(request: Request) -> Response:
            return StreamingResponse(self._events(request, count=10_000), media_type="text/event-stream")

        return Starlette(
            routes=[
                Route("/v1/loads", loads),
                Route("/ready", ready),
                Route("/forever", forever),
                Route("/{path:path}", echo, methods=["GET", "POST", "PUT", "HEAD"]),
            ]
        )

    async def _events(self, request: Request, count: int = 3, gap_s: float = 0.2) -> AsyncIterator[bytes]:
        try:
            for index in range(count):
                yield f"data: {json.dumps({'served_by': self.name, 'index': index})}\n\n".encode()
                await asyncio.sleep(gap_s)
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.disconnected.set()
            raise

    def start(self) -> None:
        sock = bind_socket("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app(), log_level="warning", lifespan="off"))
        threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        assert self.server is not None
        self.server.should_exit = True


@dataclass
class Fleet:
    front: Front
    url: str
    router: Upstream
    replicas: list[Upstream]


@pytest.fixture
def fleet(monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:
    monkeypatch.setattr(front_module, "LOAD_POLL_S", 0.05)
    router, replicas = Upstream("router"), [Upstream("replica 0", load=5), Upstream("replica 1", load=1)]
    for upstream in (router, *replicas):
        upstream.start()
    sock = bind_socket("127.0.0.1", 0, listen=False)
    options = FrontOptions(
        router_port=router.port, replica_ports=tuple(r.port for r in replicas), api_key="k"
    )
    front = Front(sock, options)
    front.start()
    yield Fleet(front, f"http://127.0.0.1:{sock.getsockname()[1]}", router, replicas)
    front.stop_taking_connections()
    front.close()
    for upstream in (router, *replicas):
        upstream.stop()


@pytest.mark.parametrize(
    ("body", "token_ids"),
    [
        ({"prompt": [1, 2, 3]}, True),
        ({"prompt": [[1, 2], [3, 4]]}, True),
        ({"model": "m", "prompt": [7], "max_tokens": 2}, True),
        ({"prompt": "hi"}, False),
        ({"prompt": ["hi", "there"]}, False),
        ({"prompt": []}, False),
        ({"prompt": "x", "schema": {"prompt": [1]}}, False),  # a nested "prompt" is not the prompt
    ],
)
def test_a_token_id_prompt_is_told_from_text_by_the_top_level_prompt(body: object, token_ids: bool) -> None:
    assert is_token_id_prompt(json.dumps(body).encode()) is token_ids


def test_text_goes_to_the_router_and_token_ids_to_the_least_loaded_ready_replica(fleet: Fleet) -> None:
    headers = {"Authorization": "Bearer client-key"}
    with httpx.Client(base_url=fleet.url, headers=headers, timeout=10) as client:
        text = client.post("/v1/completions", json={"prompt": "hi"})
        single = client.post("/v1/completions", json={"prompt": [1, 2, 3]})
        batched = client.post("/v1/completions", json={"prompt": [[1, 2], [3, 4]]})
        chat = client.post("/v1/chat/completions", json={"messages": [], "prompt": [1]})
    assert text.json()["served_by"] == "router"
    assert single.json()["served_by"] == batched.json()["served_by"] == "replica 1"  # load 1 against 5
    assert chat.json()["served_by"] == "router"  # only completions carry a prompt of token ids
    assert ["authorization", "Bearer client-key"] in single.json()[
        "headers"
    ]  # the client's key, not the front's
    fleet.replicas[1].ready = False  # asleep: its /ready is 503
    time.sleep(0.3)
    with httpx.Client(base_url=fleet.url, timeout=10) as client:
        assert client.post("/v1/completions", json={"prompt": [1]}).json()["served_by"] == "replica 0"


def test_token_id_requests_spread_over_replicas_of_equal_load(fleet: Fleet) -> None:
    fleet.replicas[0].load = fleet.replicas[1].load = 0
    time.sleep(0.3)
    with httpx.Client(base_url=fleet.url, timeout=10) as client:
        served = [client.post("/v1/completions", json={"prompt": [1]}).json()["served_by"] for _ in range(4)]
    assert sorted(served) == ["replica 0", "replica 0", "replica 1", "replica 1"], served


def test_a_request_reaches_upstream_as_sent_but_for_its_hop_by_hop_headers(fleet: Fleet) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": '
        yield b'"hi"}'

    with httpx.Client(base_url=fleet.url, timeout=10) as client:
        echoed = client.post(
            "/v1/completions?x=1",
            content=chunks(),  # sent chunked: it goes on with its length
            headers=[("Authorization", "Bearer k"), ("X-Trace", "a"), ("X-Trace", "b"), ("Keep-Alive", "5")],
        ).json()
    assert echoed["target"] == "/v1/completions?x=1" and echoed["body"] == '{"prompt": "hi"}'
    headers = [(name.lower(), value) for name, value in echoed["headers"]]
    assert ("authorization", "Bearer k") in headers
    assert [value for name, value in headers if name == "x-trace"] == ["a", "b"]
    assert ("connection", "close") in headers and ("content-length", "16") in headers
    assert not [name for name, _ in headers if name in ("keep-alive", "transfer-encoding")]


def _read_answer(sock: socket.socket, buffer: bytearray) -> tuple[bytes, bytes]:
    """One answer's head and body off `sock`, by its Content-Length or its chunks."""
    while b"\r\n\r\n" not in buffer:
        buffer += sock.recv(65536)
    end = buffer.index(b"\r\n\r\n") + 4
    head = bytes(buffer[:end])
    del buffer[:end]
    if b"transfer-encoding: chunked" in head.lower():
        while not buffer.endswith(b"0\r\n\r\n"):
            buffer += sock.recv(65536)
        body = bytes(buffer)
        buffer.clear()
        return head, body
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(buffer) < length:
        buffer += sock.recv(65536)
    body = bytes(buffer[:length])
    del buffer[:length]
    return head, body


def test_one_client_connection_carries_several_requests_with_and_without_lengths(fleet: Fleet) -> None:
    port = int(fleet.url.rsplit(":", 1)[1])
    plain = b'{"prompt": [1]}'
    streamed = b'{"prompt": [1], "stream": true}'
    buffer = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for body in (plain, streamed, plain, streamed):
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            head, answer = _read_answer(sock, buffer)
            assert head.startswith(b"HTTP/1.1 200") and b"connection: close" not in head.lower(), head
            assert b"replica" in answer and (b"[DONE]" in answer) is (body == streamed)
        # Expect: 100-continue is answered by the front, and the body then sent
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 15\r\n\r\n"
        )
        while b"\r\n\r\n" not in buffer:
            buffer += sock.recv(65536)
        assert buffer.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        del buffer[:25]
        sock.sendall(plain)
        head, answer = _read_answer(sock, buffer)
        assert head.startswith(b"HTTP/1.1 200") and b"replica" in answer
        # Connection: close is kept to: the front closes after the answer
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head, answer = _read_answer(sock, buffer)
        assert b"connection: close" in head.lower() and b"router" in answer
        assert sock.recv(65536) == b""


def test_an_event_is_not_held_back_behind_the_head_on_a_kept_alive_connection(fleet: Fleet) -> None:
    """asyncio leaves Nagle on for sockets accepted from a listening socket of protocol 0: an event
    written just after the answer's head then waits for the client's delayed ACK (40 ms)."""
    port = int(fleet.url.rsplit(":", 1)[1])
    body = b'{"prompt": [1], "stream": true, "gap_s": 0.002}'  # 3 events 2 ms apart, then [DONE]
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    answer_s = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for _ in range(4):
            sent = time.monotonic()
            sock.sendall(request)
            _read_answer(sock, bytearray())
            answer_s.append(time.monotonic() - sent)
    assert min(answer_s[1:]) < 0.035, answer_s  # held back: 40 ms or more (the first is ACKed at once)


def test_a_stream_passes_each_event_as_it_comes(fleet: Fleet) -> None:
    arrivals = []
    with (
        httpx.Client(base_url=fleet.url, timeout=10) as client,
        client.stream("POST", "/v1/completions", json={"prompt": [1, 2], "stream": True}) as stream,
    ):
        began = time.monotonic()
        for line in stream.iter_lines():
            if line:
                arrivals.append((time.monotonic() - began, line))
    assert [line for _, line in arrivals][-1] == "data: [DONE]"
    assert len(arrivals) == 4 and arrivals[0][0] < 0.15 and arrivals[-1][0] > 0.5, arrivals  # 0.2 s apart


def test_a_client_that_leaves_mid_stream_closes_the_upstream_connection(fleet: Fleet) -> None:
    with httpx.Client(base_url=fleet.url, timeout=10) as client, client.stream("GET", "/forever") as stream:
        lines = stream.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)
        time.sleep(0.3)
        assert not fleet.router.disconnected.is_set()  # a stream going on
    assert fleet.router.disconnected.wait(5), "the router's stream went on after its client left"


def test_no_ready_replica_is_a_503_that_says_so(fleet: Fleet) -> None:
    fleet.replicas[0].ready = False
    fleet.replicas[1].stop()  # its connections are refused
    time.sleep(0.5)
    with httpx.Client(base_url=fleet.url, timeout=10) as client:
        answer = client.post("/v1/completions", json={"prompt": [1, 2]})
        text = client.post("/v1/completions", json={"prompt": "hi"})
    assert answer.status_code == 503 and answer.headers["retry-after"] == "2", answer.text
    assert "No replica is ready to take a token-id prompt now" in answer.json()["error"]["message"]
    assert text.json()["served_by"] == "router"


def test_a_body_over_the_limit_is_a_413_a_client_reads_after_sending_it_all(fleet: Fleet) -> None:
    """The front refuses on the declared length, then drops the rest: closing at once would reset the
    connection under a client still sending, which would see that instead of the 413."""
    port = int(fleet.url.rsplit(":", 1)[1])
    body = b'{"prompt": "' + b"x" * (32 << 20) + b'"}'  # over the default 4 MiB, and the socket buffers
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        head, answer = _read_answer(sock, bytearray())
    assert head.startswith(b"HTTP/1.1 413"), head
    assert "over this server's limit of 4194304 bytes" in json.loads(answer)["error"]["message"]


def test_a_stopping_front_takes_no_new_connection_and_lets_a_stream_in_flight_end(fleet: Fleet) -> None:
    with (
        httpx.Client(base_url=fleet.url, timeout=10) as client,
        client.stream("POST", "/v1/completions", json={"prompt": "a", "stream": True}) as stream,
    ):
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        fleet.front.stop_taking_connections()
        time.sleep(0.1)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{fleet.url}/v1/models", timeout=2)
        assert [line for line in lines if line][-1] == "data: [DONE]"
