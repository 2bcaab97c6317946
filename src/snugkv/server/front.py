"""The front of `snugkv serve --dp N`: the address clients use, in the supervisor's own process.

smg 1.13 reads a completion's prompt as text or a list of texts only, so a token-id prompt
(`[1, 2, 3]` or `[[1, 2], [3, 4]]`: valid in the OpenAI API, and what load generators send) is
its 400, and it has no option to take one. The front listens on --host/--port and passes every
request on unchanged to smg, which listens on a loopback port, except a POST /v1/completions
whose prompt is token ids: that one goes straight to the least loaded ready replica. Either way
the answer comes back byte for byte, streams included (`front_http.py`).

Least loaded (`ReplicaLoads`): every LOAD_POLL_S the front reads each replica's `/ready` and
`/v1/loads`; a token-id request goes to the ready replica with the fewest running and queued
requests, counting those the front sent it since that reading (ties in turn). A replica that
refuses the connection is skipped for the next; with none ready, the answer is a 503 that says so.

The front runs on an event loop in a thread of its own. It starts listening once the fleet is
ready and stops taking connections first when the fleet stops: it then closes idle connections,
lets the answers in flight run to their end (the router and the replicas drain them) and closes
each connection after its answer. It owns the listening socket, the connections and the load
readings; it never checks the key (smg and the replicas do, as before) and never changes a header
but the hop-by-hop ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from snugkv.server.errors import SERVER_ERROR
from snugkv.server.front_http import ClientConnection, Refusal, Request, UpstreamConnection
from snugkv.server.sockets import BACKLOG, KEEP_ALIVE_S

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
LOAD_POLL_S = 1.0
LOAD_READ_TIMEOUT_S = 2.0
START_TIMEOUT_S = 30.0
RETRY_AFTER_S = 2

# A first look at a completion's body before any JSON is parsed: could its prompt be token ids?
_TOKEN_IDS_HINT = re.compile(rb'"prompt"\s*:\s*\[\s*[-\d\[]')


@dataclass(frozen=True, slots=True)
class FrontOptions:
    router_port: int
    replica_ports: tuple[int, ...]
    api_key: str | None = None  # to read the replicas' /v1/loads; clients' requests carry their own
    max_body_bytes: int = 4 << 20


def is_token_id_prompt(body: bytes) -> bool:
    """A completion body whose `prompt` is token ids (`[1, 2]`) or lists of them (`[[1, 2], [3]]`).
    Anything else (text, a list of texts, bad JSON) is the router's to answer."""
    if not _TOKEN_IDS_HINT.search(body):
        return False
    try:
        request = json.loads(body)
    except ValueError:
        return False
    prompt = request.get("prompt") if isinstance(request, dict) else None
    # The replica checks the rest (`[1, "a"]`, `[[]]`) and says what is wrong in its own words.
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int | list)


class ReplicaLoads:
    """What the front knows of each replica: ready or not, and its requests at the last reading plus
    those the front sent it since."""

    def __init__(self, ports: tuple[int, ...], api_key: str | None) -> None:
        self.ports = ports
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.ready = dict.fromkeys(ports, False)
        self.requests = dict.fromkeys(ports, 0)
        self._turn = 0

    async def read_all(self, http: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self._read(http, port) for port in self.ports))

    async def _read(self, http: httpx.AsyncClient, port: int) -> None:
        url = f"http://{LOOPBACK}:{port}"
        try:
            ready = (await http.get(f"{url}/ready")).status_code == 200
            loads = (await http.get(f"{url}/v1/loads", headers=self._headers)).json()["loads"]
            requests = sum(int(entry["num_total_reqs"]) for entry in loads)
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            ready, requests = False, 0
        self.ready[port], self.requests[port] = ready, requests

    def in_order(self) -> list[int]:
        """The ready replicas, least loaded first (ties: each in turn)."""
        self._turn = (self._turn + 1) % len(self.ports)
        turn = {port: (index - self._turn) % len(self.ports) for index, port in enumerate(self.ports)}
        ready = [port for port in self.ports if self.ready[port]]
        return sorted(ready, key=lambda port: (self.requests[port], turn[port]))

    def sent(self, port: int) -> None:
        self.requests[port] += 1

    def unreachable(self, port: int) -> None:
        self.ready[port] = False


class Front:
    """The listening socket and its connections, on an event loop in a thread of its own. The
    supervisor calls `start`, `stop_taking_connections` and `close`, from its own thread."""

    def __init__(self, sock: socket.socket, options: FrontOptions) -> None:
        self.sock = sock  # bound; listening from `start` on
        self.options = options
        self.loads = ReplicaLoads(options.replica_ports, options.api_key)
        self.stopping = False
        self._connections: dict[ClientConnection, asyncio.Task[None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._closing: asyncio.Event | None = None
        self._listening = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the supervisor's side ---------------------------------------------------------------
    def start(self) -> None:
        """Read the replicas' loads once, then listen; returns once listening."""
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(),), name="front", daemon=True)
        self._thread.start()
        self._listening.wait(START_TIMEOUT_S)
        if self._server is None:
            raise RuntimeError(f"the front did not start listening in {START_TIMEOUT_S:.0f} s; see the log")

    def stop_taking_connections(self) -> None:
        """Stop listening, close idle connections and each busy one after its answer."""
        self._call_soon(self._stop_listening)

    def close(self, timeout_s: float = 5.0) -> None:
        """Cut what is left and end the loop (the socket is closed however far `start` got)."""
        if self._thread is None:
            self.sock.close()
            return
        self._call_soon(self._close_soon)
        self._thread.join(timeout_s)

    def _call_soon(self, callback: Callable[[], object]) -> None:
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended
                self._loop.call_soon_threadsafe(callback)

    # -- the loop's side -----------------------------------------------------------------
    def _close_soon(self) -> None:
        if self._closing is not None:
            self._closing.set()

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._closing = asyncio.Event()
        async with httpx.AsyncClient(timeout=LOAD_READ_TIMEOUT_S) as http:
            try:
                await self.loads.read_all(http)
                self._server = await self._loop.create_server(
                    lambda: ClientConnection(self._open), sock=self.sock, backlog=BACKLOG
                )
            finally:
                self._listening.set()  # `start` returns, listening or not
            poll = asyncio.create_task(self._poll_loads(http))
            await self._closing.wait()
            poll.cancel()
            self._server.close()
            tasks = list(self._connections.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(poll, *tasks, return_exceptions=True)

    async def _poll_loads(self, http: httpx.AsyncClient) -> None:
        while True:
            await asyncio.sleep(LOAD_POLL_S)
            await self.loads.read_all(http)

    def _stop_listening(self) -> None:
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            if connection.idle and not connection.buffer:
                connection.transport.close()

    def _open(self, client: ClientConnection) -> None:
        task = asyncio.get_running_loop().create_task(self._serve(client))
        self._connections[client] = task
        task.add_done_callback(lambda _: self._connections.pop(client, None))

    async def _serve(self, client: ClientConnection) -> None:
        """The requests of one client connection, one after another."""
        try:
            while not self.stopping:
                async with asyncio.timeout(KEEP_ALIVE_S):
                    request = await client.read_request(self.options.max_body_bytes)
                if request is None:
                    break
                if self.stopping:
                    raise Refusal(
                        503,
                        "snugkv is stopping and takes no new requests; send the request again once it is back.",
                        type=SERVER_ERROR,
                        code="server_shutting_down",
                    )
                if not await self._forward(client, request):
                    break
        except Refusal as refusal:
            if not client.gone:
                client.transport.write(refusal.response())
                await client.linger()
        except (ConnectionError, TimeoutError):
            pass
        finally:
            client.transport.close()

    async def _forward(self, client: ClientConnection, request: Request) -> bool:
        """Send `request` upstream and its answer to the client; whether the connection goes on."""
        to_replica = (
            request.method == b"POST"
            and request.path == b"/v1/completions"
            and is_token_id_prompt(request.body)
        )
        ports = self.loads.in_order() if to_replica else [self.options.router_port]
        loop = asyncio.get_running_loop()
        keep_alive = request.keep_alive and not self.stopping
        for port in ports:
            try:
                _, upstream = await loop.create_connection(
                    lambda: UpstreamConnection(client, request, keep_alive=keep_alive), LOOPBACK, port
                )
            except OSError:
                if to_replica:
                    self.loads.unreachable(port)
                    continue
                raise Refusal(
                    503,
                    "The router is not answering (it is starting or restarting); try again in a few seconds.",
                    type=SERVER_ERROR,
                    retry_after_s=RETRY_AFTER_S,
                ) from None
            break
        else:
            raise Refusal(
                503,
                "No replica is ready to take a token-id prompt now (each is starting, restarting, asleep or "
                "broken: see the server log); try again in a few seconds, or send the prompt as text.",
                type=SERVER_ERROR,
                retry_after_s=RETRY_AFTER_S,
            )
        if to_replica:
            self.loads.sent(port)
        try:
            if client.gone:  # it left while the connection was made
                return False
            client.upstream = upstream
            assert upstream.transport is not None
            upstream.transport.write(request.upstream_bytes())
            await upstream.done
        finally:
            client.upstream = None
            upstream.close()
        if not upstream.head_sent and not client.gone:
            where = "replica" if to_replica else "router"
            raise Refusal(
                502,
                f"The {where} closed the connection without answering; see the server log, and try again.",
                type=SERVER_ERROR,
            )
        return upstream.keep_alive and upstream.complete and not client.gone
