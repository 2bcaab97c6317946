"""Gates in front of every route: the API key and the body size limit; and the end of a request
that the server's shutdown cuts off.

All are plain ASGI middleware so they act before FastAPI reads or parses anything: a request
without the key is refused without its body being read, and an oversized body is refused as soon
as its declared length or its received bytes pass the limit (chunked bodies included).
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from snugkv.server.errors import AUTHENTICATION, SERVER_ERROR, error_body

logger = logging.getLogger(__name__)

UNAUTHENTICATED_PATHS = frozenset({"/health", "/ready"})  # probes carry no key


class BearerAuthMiddleware:
    """Requires `Authorization: Bearer <api_key>` on every path except the probes (`/health`, `/ready`)."""

    def __init__(self, app: ASGIApp, *, api_key: str) -> None:
        self.app = app
        self._api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNAUTHENTICATED_PATHS:
            await self.app(scope, receive, send)
            return
        header = next((value for name, value in scope["headers"] if name == b"authorization"), None)
        if header is None:
            message = "Missing API key; send it as the header 'Authorization: Bearer <key>'."
        else:
            scheme, _, token = header.partition(b" ")
            if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._api_key):
                await self.app(scope, receive, send)
                return
            message = "Invalid API key; send the server's key as 'Authorization: Bearer <key>'."
        response = JSONResponse(
            error_body(message, type=AUTHENTICATION, code="invalid_api_key"),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)


class BodySizeLimitMiddleware:
    """Reads the whole body up to `max_body_bytes` before the app runs, then replays it.

    After the replayed body, `receive` goes to the server again, so the app still sees
    `http.disconnect` when the client leaves.
    """

    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._refuse(scope, receive, send, declared_bytes=int(declared))
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body; nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._refuse(scope, receive, send, declared_bytes=None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, *, declared_bytes: int | None
    ) -> None:
        size = f"is {declared_bytes} bytes, " if declared_bytes is not None else "is "
        message = (
            f"The request body {size}over this server's limit of {self.max_body_bytes} bytes; "
            "send a smaller request (or start the server with a larger body limit)."
        )
        logger.info("Refused an oversized request body on %s", scope["path"])
        response = JSONResponse(error_body(message, code="request_too_large"), status_code=413)
        response.headers["Connection"] = "close"
        await response(scope, receive, send)


class ShutdownCutoffMiddleware:
    """A request still running at the graceful-shutdown deadline (uvicorn cancels its task), e.g. a
    client that stalled mid-body: a 503 in the OpenAI shape if nothing was sent yet, and one log
    line, instead of a CancelledError traceback and a plain-text 500.

    Only uvicorn cancels a request's task (a client that leaves is a disconnect message), so a
    cancellation that reaches this middleware is the shutdown's.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_and_track(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_track)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # handled here: the request ends now
            outcome = "its response was cut short" if started else "answered 503"
            logger.warning(
                "%s %s was still running at the shutdown deadline; %s",
                scope["method"],
                scope["path"],
                outcome,
            )
            if not started:
                message = "The server shut down before this request finished; send it again once it is back."
                response = JSONResponse(
                    error_body(message, type=SERVER_ERROR, code="server_shutting_down"),
                    status_code=503,
                    headers={"Connection": "close"},
                )
                await response(scope, receive, send)
