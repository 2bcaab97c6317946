"""The FastAPI app: routes, wired to an `EngineClient` (snugkv.core.engine_client) and nothing else.

Routes:
    POST /v1/completions, POST /v1/chat/completions   generation, JSON or server-sent events
    GET  /v1/models, /v1/models/{id}                   the one served model
    GET  /health                                       200 when the engine is healthy, else 503 (no key)
    GET  /server_info, /get_server_info                the engine's sizing, ledger and arguments
                                                       (?steps=true: the last steps one by one)
    GET  /metrics                                      Prometheus text
    GET  /openapi.json                                 the OpenAPI schema of all of them
    GET  /v1/loads, /ready                             load for a router, readiness (see `loads`)
    POST /kv/resize, GET /kv                           elastic memory (see `elastic_routes`)
    POST /sleep, /wake_up, GET /is_sleeping            sleep and wake (and SGLang's names for them)

Request checking lives in `prepare`, running on the engine in `serving`, response shapes in
`formats`, the key and body limit in `middleware`. The app keeps no per-request state of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from snugkv.core.engine_client import EngineClient
from snugkv.server.elastic_routes import install_elastic_routes, install_sleep_routes
from snugkv.server.errors import NOT_FOUND, SERVER_ERROR, APIError, install_error_handlers
from snugkv.server.formats import ChatFormat, CompletionFormat, ResponseFormat
from snugkv.server.loads import install_load_routes
from snugkv.server.metrics import ServerMetrics
from snugkv.server.middleware import BearerAuthMiddleware, BodySizeLimitMiddleware, ShutdownCutoffMiddleware
from snugkv.server.openapi import install_openapi, request_body
from snugkv.server.prepare import (
    PreparedRequest,
    SequenceLimit,
    parse_body,
    prepare_chat,
    prepare_completion,
)
from snugkv.server.profile_routes import install_profile_routes
from snugkv.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from snugkv.server.serving import EventStreamResponse, collect_response, stream_events
from snugkv.server.tool_format import ToolCallFormat
from snugkv.version import __version__

logger = logging.getLogger(__name__)


def create_app(
    client: EngineClient,
    *,
    api_key: str | None,
    max_body_bytes: int,
    served_model_name: str,
    metrics: ServerMetrics | None = None,
) -> FastAPI:
    """An app serving the engine behind `client` as `served_model_name`; pass `metrics` to share it
    with the engine's driver."""
    metrics = metrics if metrics is not None else ServerMetrics()
    # GET /openapi.json describes every route, with the generation routes' bodies (`openapi`).
    app = FastAPI(title="snugkv", version=__version__, docs_url=None, redoc_url=None)
    app.state.client = client
    app.state.metrics = metrics
    install_error_handlers(app)
    # Starlette runs the middleware added last first: the key is checked before the body is read.
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(BearerAuthMiddleware, api_key=api_key)
    app.add_middleware(ShutdownCutoffMiddleware)
    created = int(time.time())
    limit = SequenceLimit.of(client)  # the engine is sized by now; the limit does not change

    def model_card() -> ModelCard:
        return ModelCard(id=served_model_name, created=created, max_model_len=limit.tokens)

    async def run(prepared: PreparedRequest, request: Request, response_format: ResponseFormat) -> Response:
        if client.is_sleeping():
            raise APIError(
                503,
                "The engine is asleep: its memory is released. Wake it (POST /wake_up or "
                "/resume_memory_occupation), then send the request again.",
                type=SERVER_ERROR,
                code="engine_asleep",
            )
        if prepared.stream:
            return EventStreamResponse(stream_events(prepared, client, metrics, request, response_format))
        return await collect_response(prepared, client, metrics, request, response_format)

    @app.post(
        "/v1/completions",
        openapi_extra={"requestBody": request_body(CompletionRequest)},
        responses={200: {"model": CompletionResponse}},
    )
    async def completions(request: Request) -> Response:
        body = parse_body(await request.body(), CompletionRequest)
        args = (body, client, served_model_name, limit)
        if _has_text(body.prompt):  # tokenized on a worker thread: the event loop goes on streaming
            prepared = await asyncio.to_thread(prepare_completion, *args)
        else:
            prepared = prepare_completion(*args)
        return await run(prepared, request, CompletionFormat())

    @app.post(
        "/v1/chat/completions",
        openapi_extra={"requestBody": request_body(ChatCompletionRequest)},
        responses={200: {"model": ChatCompletionResponse}},
    )
    async def chat_completions(request: Request) -> Response:
        body = parse_body(await request.body(), ChatCompletionRequest)
        # the chat template and the tokenizer run on a worker thread: the event loop goes on streaming
        prepared = await asyncio.to_thread(prepare_chat, body, client, served_model_name, limit)
        chat_format = ChatFormat() if prepared.tools is None else ToolCallFormat(prepared.tools)
        return await run(prepared, request, chat_format)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> ModelCard:
        if model_id != served_model_name:
            raise APIError(
                404,
                f"The model '{model_id}' does not exist here; this server serves '{served_model_name}'.",
                type=NOT_FOUND,
                param="model",
                code="model_not_found",
            )
        return model_card()

    @app.get("/health")
    async def health() -> Response:
        try:
            healthy = client.check_health()
        except Exception:
            logger.exception("The engine's health check raised")
            healthy = False
        if healthy:
            return JSONResponse({"status": "ok"})
        raise APIError(503, "The engine is not healthy; see the server log.", type=SERVER_ERROR)

    async def server_info(steps: bool = False) -> Any:
        info = client.server_info().to_dict()
        if steps:  # ?steps=true: the last steps one by one (a benchmark's)
            info["recent_steps"] = [list(record) for record in client.recent_steps()]
        return {"served_model_name": served_model_name, "version": __version__, **jsonable_encoder(info)}

    app.add_api_route("/server_info", server_info, methods=["GET"])
    app.add_api_route("/get_server_info", server_info, methods=["GET"])
    install_elastic_routes(app, client)
    install_sleep_routes(app, client)
    install_openapi(app)
    install_load_routes(app, client, metrics)
    install_profile_routes(app, client)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        try:
            metrics.update_from_snapshot(client.metrics_snapshot())
        except Exception:
            logger.exception("Reading the engine's metrics failed; serving the server-side ones")
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _has_text(prompt: object) -> bool:
    """Whether a completion's prompt (a string, a list of strings or of token ids, or lists of
    those) holds text to tokenize."""
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, list) and any(isinstance(item, str) for item in prompt)
