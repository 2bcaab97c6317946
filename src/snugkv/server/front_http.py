"""HTTP/1.1 as the front (`front.py`) speaks it: a request read off a client connection, and an
answer passed back to the client byte for byte as it arrives.

A request is read whole (its head, then its body by Content-Length or chunks, up to a limit) and
goes upstream with its own line and headers, the hop-by-hop ones set anew: `Connection: close`,
and the body's length. The answer's head is read for its framing alone (a length, chunks, or none)
and its Connection header rewritten for the client's connection; every byte after it is written
to the client in the callback that receives it, with no parsing and no task switch, so a stream's
events cost one write each. With `Connection: close` upstream, the end of an answer is the end of
its connection; the client's connection goes on only if it could tell that end itself (a length
fully sent, a chunked body's last chunk, or no body).

This module never decides where a request goes (the front does) and never reads an answer's body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Callable
from dataclasses import dataclass

from snugkv.server.errors import INVALID_REQUEST, error_body

MAX_HEAD_BYTES = 64 * 1024
LINGER_S = 2.0
# Set anew toward upstream (the rest of a request's headers go as they came).
_REQUEST_HOP_HEADERS = frozenset(
    {b"connection", b"keep-alive", b"expect", b"transfer-encoding", b"content-length"}
)
_RESPONSE_HOP_HEADERS = frozenset({b"connection", b"keep-alive"})
_REASONS = {
    400: "Bad Request",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


class Refusal(Exception):
    """A request the front answers itself (in the OpenAI error shape), closing the connection."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        code: str | None = None,
        retry_after_s: int = 0,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.retry_after_s = retry_after_s

    def response(self) -> bytes:
        body = json.dumps(error_body(self.message, type=self.type, code=self.code)).encode()
        head = [
            f"HTTP/1.1 {self.status} {_REASONS.get(self.status, 'Error')}",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            "Connection: close",
        ]
        if self.retry_after_s:
            head.append(f"Retry-After: {self.retry_after_s}")
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body


@dataclass(slots=True)
class Request:
    method: bytes
    target: bytes
    version: bytes
    header_lines: list[bytes]  # as received, the request line left out
    fields: dict[bytes, list[bytes]]  # lower-cased name -> its values
    body: bytes = b""

    @property
    def path(self) -> bytes:
        return self.target.split(b"?", 1)[0]

    def tokens(self, name: bytes) -> set[bytes]:
        """The comma-separated values of header `name`, lower-cased."""
        return {token.strip().lower() for value in self.fields.get(name, []) for token in value.split(b",")}

    @property
    def keep_alive(self) -> bool:
        connection = self.tokens(b"connection")
        if self.version == b"HTTP/1.0":
            return b"keep-alive" in connection
        return b"close" not in connection

    def upstream_bytes(self) -> bytes:
        """The request as it goes upstream: its line and headers, the hop-by-hop ones set anew."""
        lines = [b" ".join((self.method, self.target, self.version))]
        lines += [line for line in self.header_lines if _name(line) not in _REQUEST_HOP_HEADERS]
        if self.body or b"content-length" in self.fields or b"transfer-encoding" in self.fields:
            lines.append(b"Content-Length: %d" % len(self.body))
        lines.append(b"Connection: close")
        return b"\r\n".join(lines) + b"\r\n\r\n" + self.body


def _name(header_line: bytes) -> bytes:
    return header_line.split(b":", 1)[0].strip().lower()


def parse_head(head: bytes) -> Request:
    request_line, *header_lines = head.split(b"\r\n")
    parts = request_line.split(b" ")
    if len(parts) != 3 or not parts[0].isalpha():
        raise Refusal(400, "The request line is not 'METHOD /path HTTP/1.1'; send an HTTP/1.1 request.")
    method, target, version = parts
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise Refusal(505, f"{version.decode(errors='replace')} is not served here; send HTTP/1.1.")
    fields: dict[bytes, list[bytes]] = {}
    for line in header_lines:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise Refusal(400, "A header line is not 'Name: value'; send well-formed headers.")
        fields.setdefault(name.lower(), []).append(value.strip())
    return Request(method, target, version, header_lines, fields)


class ClientConnection(asyncio.Protocol):
    """One client's connection: the bytes it sent that are not read yet, and the upstream it feeds."""

    def __init__(self, on_open: Callable[[ClientConnection], None]) -> None:
        self._on_open = on_open
        self.buffer = bytearray()
        self.gone = False  # EOF or reset: nothing more comes, nothing more can be sent
        self.idle = False  # waiting for a request's first byte: a stopping front may close it
        self.paused = False  # its write buffer is full: the upstream is not read meanwhile
        self.draining = False  # refused: what it still sends is dropped
        self.upstream: UpstreamConnection | None = None
        self.transport: asyncio.Transport
        self._waiter: asyncio.Future[None] | None = None

    # -- asyncio's callbacks ------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        # asyncio turns Nagle off only on sockets made with IPPROTO_TCP, and a listening socket made
        # with protocol 0 (`sockets.bind_socket`) passes 0 on: without this, an event written after
        # the answer's head waits for the client's delayed ACK (40 ms) on a kept-alive connection.
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._on_open(self)

    def data_received(self, data: bytes) -> None:
        if not self.draining:
            self.buffer += data
        self._wake()

    def eof_received(self) -> bool:
        self._leave()
        return False  # close: a client that stops sending is taken to have left

    def connection_lost(self, exc: Exception | None) -> None:
        self._leave()

    def pause_writing(self) -> None:
        self.paused = True
        if self.upstream is not None:
            self.upstream.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.upstream is not None:
            self.upstream.resume_reading()

    def _leave(self) -> None:
        self.gone = True
        self._wake()
        if self.upstream is not None:
            self.upstream.close()  # the replica sees the disconnect and aborts the request

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def linger(self) -> None:
        """After a refusal: half-close and drop what the client still sends (the rest of a body too
        large) until it closes or LINGER_S pass. Closing while it sends would make the kernel reset
        the connection, and the client would see that instead of the refusal."""
        self.draining = True
        self.buffer.clear()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(LINGER_S):
                while True:
                    await self._more()

    # -- reading a request ----------------------------------------------------------------
    async def _more(self) -> None:
        if not self.gone:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if self.gone:
            raise ConnectionResetError("the client closed its connection")

    async def read_request(self, max_body_bytes: int) -> Request | None:
        """The next request, body included (None: the client closed its connection between requests)."""
        self.idle = not self.buffer
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            if len(self.buffer) > MAX_HEAD_BYTES:
                raise Refusal(
                    431,
                    f"The request line and headers are over {MAX_HEAD_BYTES // 1024} KiB; send smaller "
                    "headers (put large values in the body).",
                    code="request_header_fields_too_large",
                )
            if self.gone and not self.buffer:
                return None
            await self._more()
            self.idle = False
        self.idle = False
        request = parse_head(bytes(self.buffer[:end]))
        del self.buffer[: end + 4]
        request.body = await self._read_body(request, max_body_bytes)
        return request

    async def _read_body(self, request: Request, max_body_bytes: int) -> bytes:
        encodings = request.tokens(b"transfer-encoding") - {b""}
        if encodings and encodings != {b"chunked"}:
            raise Refusal(400, "Only a chunked Transfer-Encoding is taken; send the body as is or in chunks.")
        lengths = set(request.fields.get(b"content-length", []))
        if not encodings and (len(lengths) > 1 or not all(length.isdigit() for length in lengths)):
            raise Refusal(
                400, "The Content-Length header is not one number; send the body's length in bytes."
            )
        size = int(lengths.pop()) if lengths and not encodings else 0
        if size > max_body_bytes:
            raise _too_large(max_body_bytes, size)
        if (size or encodings) and b"100-continue" in request.tokens(b"expect"):
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if encodings:
            return await self._read_chunks(max_body_bytes)
        return await self._read_exactly(size)

    async def _read_chunks(self, max_body_bytes: int) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            line = await self._read_line()
            try:
                chunk_bytes = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise Refusal(
                    400, "A chunk of the request body has no size in hex; send valid chunks."
                ) from None
            if chunk_bytes == 0:
                while await self._read_line():  # trailers, up to the empty line
                    pass
                return b"".join(chunks)
            size += chunk_bytes
            if size > max_body_bytes:
                raise _too_large(max_body_bytes, None)
            chunks.append(await self._read_exactly(chunk_bytes))
            if await self._read_exactly(2) != b"\r\n":
                raise Refusal(400, "A chunk of the request body is longer than its size; send valid chunks.")

    async def _read_exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            await self._more()
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    async def _read_line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            if len(self.buffer) > MAX_HEAD_BYTES:
                raise Refusal(400, "A chunk-size or trailer line of the request body is over 64 KiB.")
            await self._more()
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return line


def _too_large(max_body_bytes: int, declared_bytes: int | None) -> Refusal:
    size = f"is {declared_bytes} bytes, " if declared_bytes is not None else "is "
    return Refusal(
        413,
        f"The request body {size}over this server's limit of {max_body_bytes} bytes; send a smaller "
        "request (or start the server with a larger --max-body-bytes).",
        code="request_too_large",
    )


class UpstreamConnection(asyncio.Protocol):
    """One request's connection to smg or a replica: the answer's head is rewritten for the client's
    connection, the rest written to the client as it comes."""

    def __init__(self, client: ClientConnection, request: Request, *, keep_alive: bool) -> None:
        self.client = client
        self.no_body = request.method == b"HEAD"  # the answer is a head only
        self.keep_alive = keep_alive  # asked for: the client's wish, unless the front is stopping
        self.client_http10 = request.version == b"HTTP/1.0"
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.head = bytearray()
        self.head_sent = False
        self.remaining_bytes: int | None = None  # of a body with a length
        self.chunked = False
        self.tail = b""  # the last bytes of a chunked body, which ends "0\r\n\r\n"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.client.paused:
            transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        if self.client.gone:
            return
        if self.head_sent:
            self._pass_body(data)
            return
        self.head += data
        while (end := self.head.find(b"\r\n\r\n")) >= 0 and self.head.startswith(b"HTTP/1.1 1"):
            self.client.transport.write(self.head[: end + 4])  # an interim answer (1xx) goes as it is
            del self.head[: end + 4]
        if end < 0:
            if len(self.head) > MAX_HEAD_BYTES:
                self.close()
            return
        head, rest = bytes(self.head[:end]), bytes(self.head[end + 4 :])
        self.head.clear()
        self.client.transport.write(self._client_head(head) + rest)
        self.head_sent = True
        self._count_body(rest)
        if self.complete:
            self.close()  # nothing more comes; no need to wait for upstream's close

    def _client_head(self, head: bytes) -> bytes:
        status_line, *lines = head.split(b"\r\n")
        status = int(status_line.split(b" ", 2)[1])
        self.no_body = self.no_body or status in (204, 304)
        kept = []
        for line in lines:
            name = _name(line)
            if name in _RESPONSE_HOP_HEADERS:
                continue
            value = line.partition(b":")[2].strip().lower()
            if name == b"content-length" and value.isdigit():
                self.remaining_bytes = int(value)
            elif name == b"transfer-encoding":
                self.chunked = value.endswith(b"chunked")
            kept.append(line)
        framed = self.no_body or self.chunked or self.remaining_bytes is not None
        self.keep_alive = self.keep_alive and framed
        if not self.keep_alive:
            kept.append(b"Connection: close")
        elif self.client_http10:
            kept.append(b"Connection: keep-alive")
        return b"\r\n".join([status_line, *kept]) + b"\r\n\r\n"

    def _pass_body(self, data: bytes) -> None:
        self.client.transport.write(data)
        self._count_body(data)
        if self.remaining_bytes is not None and self.remaining_bytes <= 0:
            self.close()

    def _count_body(self, data: bytes) -> None:
        if self.remaining_bytes is not None:
            self.remaining_bytes -= len(data)
        elif self.chunked and data:
            self.tail = data[-5:] if len(data) >= 5 else (self.tail + data)[-5:]

    @property
    def complete(self) -> bool:
        """The client can tell where the answer ended."""
        if not self.head_sent:
            return False
        if self.no_body:
            return True
        if self.remaining_bytes is not None:
            return self.remaining_bytes == 0
        return self.chunked and self.tail == b"0\r\n\r\n"

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def pause_reading(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
