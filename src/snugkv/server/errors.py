"""Errors the server shows to clients, always in the OpenAI shape.

Every failure leaves as `{"error": {"message", "type", "param", "code"}}` with a message that says
what to change. Code anywhere in the server raises `APIError`; the handlers installed here turn it
(and Starlette's own 404/405, pydantic validation errors and anything unexpected) into that JSON.
This module never looks at request contents beyond what an error carries.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """A request that fails with `status_code`; `message` is shown to the client as is."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers  # e.g. a 503's Retry-After

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status_code == 401 else {}
        return JSONResponse(
            self.body(), status_code=self.status_code, headers={**headers, **(self.headers or {})}
        )


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_body(
    message: str, *, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, as a sentence naming the field and what it needs."""
    return _from_first_error(exc.errors(include_url=False)[0])


def _from_first_error(first: Any) -> APIError:
    loc = tuple(first["loc"])
    if len(loc) > 1 and loc[0] in ("query", "path"):  # FastAPI's own checks name where the field is
        loc = loc[1:]
    param = format_location(loc)
    if first["type"] == "missing":
        return bad_request(f"'{param}' is required; add it to the request body.", param=param)
    message = str(first["msg"]).removeprefix("Value error, ")
    if first["type"].endswith("_type") or first["type"].endswith("_parsing"):
        given = _short_repr(first.get("input"))
        return bad_request(f"Invalid type for '{param}': {message}, got {given}.", param=param)
    return bad_request(f"Invalid value for '{param}': {message}.", param=param)


def format_location(loc: tuple[int | str, ...]) -> str:
    """`("messages", 0, "role")` -> `messages[0].role`."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "body"


def _short_repr(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _query_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _from_first_error(exc.errors()[0]).response()  # e.g. GET /server_info?steps=maybe

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"There is no endpoint {request.url.path}; see GET /v1/models and POST /v1/completions."
            return APIError(404, message, type=NOT_FOUND).response()
        if exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}."
            return APIError(405, message).response()
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("Unhandled error on %s %s", request.method, request.url.path)
        message = f"The server failed on this request ({type(exc).__name__}); it is logged and others are unaffected."
        return APIError(500, message, type=SERVER_ERROR).response()
