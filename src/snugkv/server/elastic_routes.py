"""HTTP routes of elastic memory: resizing the KV cache while serving, sleeping and waking.

    POST /kv/resize   {"max_total_num_tokens": N} or {"free_gib": X}: grow or shrink the KV cache
    GET  /kv          its size now, committed and reserved bytes, usage, what a resize would need
    POST /sleep?level=1|2[&tags=...]     release the KV cache and the weights (vLLM's names; level 1
                                         keeps the weights in host memory, level 2 drops them);
                                         tags=cuda_graph also releases the graphs (wake captures them)
    POST /wake_up[?tags=weights,kv_cache,cuda_graph]  take them back (all by default)
    GET  /is_sleeping
    GET  /kv/engines  --kv-elastic: every engine sharing this device, its KV cache, share and target
    POST /release_memory_occupation, /resume_memory_occupation   SGLang's names for the same, with
                                         an optional body {"tags": [...]} (and "level" to release)

While asleep, generation requests get a 503 (app.py) and requests already queued wait.

Every route reaches the engine through the client's elastic calls, which run on the scheduler
thread between steps (and on every tensor-parallel rank). A refused resize is a 400 (a value
outside the limits, named in the message) or a 409 (the engine's state refuses it: asleep, sized
without virtual memory, memory taken meanwhile), as the engine's `KvResizeError` says.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request

from snugkv.core.engine_client import EngineClient
from snugkv.memory.vmm import MIB
from snugkv.memory_share.share import MemoryShare
from snugkv.server.errors import SERVER_ERROR, APIError
from snugkv.sizing.resize import KvResizeError

RESIZE_EXAMPLE = '{"max_total_num_tokens": 65536} or {"free_gib": 4}'


def api_error(exc: KvResizeError) -> APIError:
    return APIError(exc.status, str(exc), param=exc.param, code="kv_resize_refused")


async def json_object(request: Request, example: str) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw.decode("utf-8-sig")) if raw.strip() else None
    except UnicodeDecodeError:
        raise APIError(
            400, f"The body is not UTF-8 text; send a UTF-8 JSON object such as {example}."
        ) from None
    except json.JSONDecodeError as exc:
        raise APIError(
            400, f"The body is not valid JSON ({exc.msg}); send an object such as {example}."
        ) from exc
    if not isinstance(body, dict):
        raise APIError(400, f"The body must be a JSON object such as {example}.")
    return body


def with_what_it_freed(result: dict[str, Any]) -> dict[str, Any]:
    """The resize's answer with `freed_bytes`, and a `warning` when a shrink gave no memory back
    (each buffer keeps the extension its new end falls in whole: a client that shrank by less than
    one extension per buffer must not have to read the server's log to learn it freed nothing)."""
    freed_bytes = result.get("from_committed_bytes", 0) - result.get("to_committed_bytes", 0)
    shrank = result.get("to_tokens", 0) < result.get("from_tokens", 0)
    answer = {**result, "freed_bytes": max(freed_bytes, 0)}
    if shrank and freed_bytes <= 0:
        chunk = (result.get("kv") or {}).get("chunk_bytes")
        chunk_text = f" of {chunk / MIB:g} MiB" if isinstance(chunk, int) else ""
        answer["warning"] = (
            f"The KV cache now hands out {result['to_tokens']} tokens, but no memory was freed: each "
            f"buffer keeps the extension{chunk_text} its new end falls in whole, and this shrink stayed "
            "inside them. Shrink by more (free_gib asks in bytes and always frees what it asks), or "
            "start the server with a smaller --kv-chunk-mib."
        )
    return answer


def json_body(properties: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI `requestBody` of a route that reads a JSON object by hand (server/openapi.py)."""
    schema = {"type": "object", "properties": properties, "additionalProperties": False}
    return {"requestBody": {"required": False, "content": {"application/json": {"schema": schema}}}}


def _query(*parameters: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return {"parameters": [{"name": name, "in": "query", "schema": schema} for name, schema in parameters]}


_TAGS = {"type": "array", "items": {"type": "string"}}
_TAGS_QUERY = ("tags", {"type": "string", "description": "comma-separated: weights, kv_cache, cuda_graph"})


def install_elastic_routes(app: FastAPI, client: EngineClient) -> None:
    @app.post(
        "/kv/resize",
        openapi_extra=json_body(
            {"max_total_num_tokens": {"type": "integer"}, "free_gib": {"type": "number"}}
        ),
    )
    async def resize_kv(request: Request) -> Any:
        body = await json_object(request, RESIZE_EXAMPLE)
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
            reply = await client.resize_kv(
                max_total_num_tokens=body.get("max_total_num_tokens"), free_gib=body.get("free_gib")
            )
        except KvResizeError as exc:
            raise api_error(exc) from exc
        return with_what_it_freed(reply.to_dict())

    @app.get("/kv")
    async def kv_info() -> Any:
        try:
            return (await client.kv_info()).to_dict()
        except KvResizeError as exc:
            raise api_error(exc) from exc
        except RuntimeError as exc:  # the scheduler loop is gone
            raise APIError(503, f"The engine cannot answer: {exc}", type=SERVER_ERROR) from exc


def _level(value: object) -> int:
    if str(value).strip() not in ("1", "2"):
        raise APIError(
            400,
            f"level must be 1 (weights kept in host memory) or 2 (weights dropped), got {value!r}.",
            param="level",
            code="invalid_parameter",
        )
    return int(str(value))


def _query_tags(request: Request) -> tuple[str, ...]:
    """`?tags=weights,kv_cache` or `?tags=weights&tags=kv_cache` (none: all)."""
    return tuple(
        tag.strip()
        for value in request.query_params.getlist("tags")
        for tag in value.split(",")
        if tag.strip()
    )


async def _body_tags(request: Request) -> tuple[tuple[str, ...], object]:
    """SGLang's optional body: {"tags": [...]} (and, to release, a "level")."""
    raw = await request.body()
    if not raw.strip():
        return (), None
    body = await json_object(request, '{"tags": ["weights", "kv_cache"]}')
    tags = body.get("tags") or []
    if not isinstance(tags, list) or not all(isinstance(tag, str) for tag in tags):
        raise APIError(400, 'tags must be a list of names such as ["weights", "kv_cache"].', param="tags")
    return tuple(tags), body.get("level")


def install_sleep_routes(app: FastAPI, client: EngineClient) -> None:
    async def sleep_with(level: int, tags: tuple[str, ...]) -> Any:
        try:
            return (await client.sleep(level=level, tags=tags)).to_dict()
        except KvResizeError as exc:
            raise api_error(exc) from exc

    async def wake_with(tags: tuple[str, ...]) -> Any:
        try:
            return (await client.wake_up(tags=tags)).to_dict()
        except KvResizeError as exc:
            raise api_error(exc) from exc

    @app.post("/sleep", openapi_extra=_query(("level", {"type": "integer", "enum": [1, 2]}), _TAGS_QUERY))
    async def sleep(request: Request) -> Any:
        return await sleep_with(_level(request.query_params.get("level", "1")), _query_tags(request))

    @app.post("/wake_up", openapi_extra=_query(_TAGS_QUERY))
    async def wake_up(request: Request) -> Any:
        return await wake_with(_query_tags(request))

    @app.get("/is_sleeping")
    async def is_sleeping() -> Any:
        return client.sleep_state().to_dict()

    @app.post(
        "/release_memory_occupation",
        openapi_extra=json_body({"tags": _TAGS, "level": {"type": "integer", "enum": [1, 2]}}),
    )
    async def release_memory_occupation(request: Request) -> Any:
        tags, level = await _body_tags(request)
        return await sleep_with(_level(level if level is not None else 1), tags)

    @app.post("/resume_memory_occupation", openapi_extra=json_body({"tags": _TAGS}))
    async def resume_memory_occupation(request: Request) -> Any:
        tags, _ = await _body_tags(request)
        return await wake_with(tags)


def install_share_routes(app: FastAPI, share: MemoryShare) -> None:
    """GET /kv/engines: every engine registered on this device, its KV, share and target."""

    @app.get("/kv/engines")
    async def kv_engines() -> Any:
        return share.snapshot()
