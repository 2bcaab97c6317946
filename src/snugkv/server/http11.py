"""The HTTP/1.1 connection: uvicorn's h11 protocol, with a 431 a client can read for headers too large.

h11 stops buffering a request whose headers pass `h11.DEFAULT_MAX_INCOMPLETE_EVENT_SIZE` (16 KiB)
and hints 431; uvicorn answers every such protocol error with a 400 and closes the socket at once.
Closing while the client is still sending the rest of its headers makes the kernel reset the
connection, and the client sees "connection reset" instead of any status. Here the answer is a 431
in the OpenAI error shape, and the connection lingers, reading and dropping what the client still
sends, until the client closes it or `LINGER_S` passes: the client reads the answer in full.
Other protocol errors keep uvicorn's 400.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import H11Protocol

from snugkv.server.errors import error_body

logger = logging.getLogger(__name__)

LINGER_S = 2.0
HEADERS_TOO_LARGE = 431


class HttpProtocol(H11Protocol):
    """uvicorn's h11 protocol (pass as `uvicorn.Config(http=HttpProtocol)`)."""

    _draining = False
    _linger: asyncio.TimerHandle | None = None

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this inside its `except h11.RemoteProtocolError`, so the error is at hand.
        error = sys.exception()
        if not isinstance(error, h11.RemoteProtocolError) or error.error_status_hint != HEADERS_TOO_LARGE:
            super().send_400_response(msg)
            return
        logger.info(
            "Refused a request whose headers are over %d bytes (431)", DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        )
        message = (
            f"The request line and headers are over {DEFAULT_MAX_INCOMPLETE_EVENT_SIZE // 1024} KiB, "
            "this server's limit; send smaller headers (put large values in the body)."
        )
        body = json.dumps(error_body(message, code="request_header_fields_too_large")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(
                status_code=HEADERS_TOO_LARGE, headers=headers, reason=b"Request Header Fields Too Large"
            ),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self._drain_then_close()

    def _drain_then_close(self) -> None:
        """Half-close (the answer is complete), drop what still arrives, close when the client does."""
        self._draining = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger = self.loop.call_later(LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if self._draining:
            return
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self._draining:
            self.transport.close()
            return
        super().shutdown()
