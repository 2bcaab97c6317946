"""HTTP routes of elastic memory: resizing the KV cache while serving.

    POST /kv/resize   {"max_total_num_tokens": N} or {"free_gib": X}: grow or shrink the KV cache
    GET  /kv          its size now, committed and reserved bytes, usage, what a resize would need

Every route reaches the engine through the async engine's elastic methods, which run on the
scheduler thread between steps (and on every tensor-parallel rank). A refused resize is a 400 (a
value outside the limits, named in the message) or a 409 (the engine's state refuses it: asleep,
sized without virtual memory, memory taken meanwhile). An engine without elastic memory answers 501.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request

from snugkv.server.errors import SERVER_ERROR, APIError
from snugkv.sizing.resize import KvResizeError

RESIZE_EXAMPLE = '{"max_total_num_tokens": 65536} or {"free_gib": 4}'


def _elastic(engine: Any, method: str) -> Any:
    function = getattr(engine, method, None)
    if function is None:
        raise APIError(501, f"This engine cannot change its memory at run time (it has no {method}).")
    return function


def api_error(exc: KvResizeError) -> APIError:
    return APIError(exc.status, str(exc), param=exc.param, code="kv_resize_refused")


async def _json_object(request: Request, example: str) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else None
    except json.JSONDecodeError as exc:
        raise APIError(
            400, f"The body is not valid JSON ({exc.msg}); send an object such as {example}."
        ) from exc
    if not isinstance(body, dict):
        raise APIError(400, f"The body must be a JSON object such as {example}.")
    return body


def install_elastic_routes(app: FastAPI, engine: Any) -> None:
    @app.post("/kv/resize")
    async def resize_kv(request: Request) -> Any:
        resize = _elastic(engine, "resize_kv")
        body = await _json_object(request, RESIZE_EXAMPLE)
        known = {"max_total_num_tokens", "free_gib"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise APIError(
                400, f"Unknown field(s) {', '.join(unknown)}; send {RESIZE_EXAMPLE}.", param=unknown[0]
            )
        if len(set(body) & known) != 1:
            raise APIError(
                400, f"Give exactly one of max_total_num_tokens and free_gib, e.g. {RESIZE_EXAMPLE}."
            )
        try:
            return await resize(**body)
        except KvResizeError as exc:
            raise api_error(exc) from exc

    @app.get("/kv")
    async def kv_info() -> Any:
        try:
            return await _elastic(engine, "kv_info")()
        except KvResizeError as exc:
            raise api_error(exc) from exc
        except RuntimeError as exc:  # the scheduler loop is gone
            raise APIError(503, f"The engine cannot answer: {exc}", type=SERVER_ERROR) from exc
