"""Running a prepared request on the engine and answering in the OpenAI format.

`FanOut` runs one engine stream per choice and yields their outputs as they arrive (a single
choice is read straight from its engine stream: no task, no queue in between). Whatever way
the HTTP request ends (finished, engine error, client gone, server shutting down), `FanOut.close`
aborts every engine request that has not finished, synchronously, so its KV slots are freed at
once and no cancellation can skip it. `stream_events` answers as server-sent events (a client
that leaves is seen by the response, `EventStreamResponse`, which then closes the events: no poll
per chunk); `collect_response` answers with one JSON body and watches for the client leaving
meanwhile.
This module never validates input (see `prepare`) and never touches engine internals.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator
from typing import cast

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from snugkv.core.engine_client import EngineClient
from snugkv.core.outputs import GenerateInput, GenerateOutput
from snugkv.core.sampling import InvalidRequest
from snugkv.server.errors import SERVER_ERROR, APIError
from snugkv.server.formats import ChoiceState, ResponseFormat, usage_of
from snugkv.server.metrics import RequestTracker, ServerMetrics
from snugkv.server.prepare import PreparedRequest
from snugkv.server.sse import SSE_DONE, TextDeltas, sse

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer
_STREAM_END = object()


class FanOut:
    """The engine streams of one HTTP request's choices, merged in arrival order."""

    def __init__(self, client: EngineClient, inputs: list[GenerateInput], metrics: ServerMetrics) -> None:
        self._client = client
        self._metrics = metrics
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._unfinished = {gi.rid: index for index, gi in enumerate(inputs)}
        self._inputs = inputs
        self._trackers: list[RequestTracker] = [metrics.track() for _ in inputs]
        self._open_streams = len(inputs)
        self._closed = False
        metrics.in_flight.inc()
        # One choice: its stream is read in the caller's task. Several: a task per stream.
        self._single: AsyncIterator[GenerateOutput] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        if len(inputs) == 1:
            self._single = aiter(client.generate(inputs[0]))
        else:
            self._tasks = [asyncio.create_task(self._pump(index, gi)) for index, gi in enumerate(inputs)]

    async def _pump(self, index: int, request: GenerateInput) -> None:
        stream: AsyncGenerator[GenerateOutput, None] | None = None
        try:
            stream = self._client.generate(request)
            async for output in stream:
                self._queue.put_nowait((index, output))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._queue.put_nowait((index, exc))
        finally:
            if stream is not None:
                try:
                    await stream.aclose()
                except Exception:
                    logger.exception("Closing the engine stream of %s failed", request.rid)
            self._queue.put_nowait((index, _STREAM_END))

    def __aiter__(self) -> FanOut:
        return self

    async def _next_item(self) -> tuple[int, object]:
        if self._single is None:
            return await self._queue.get()
        try:
            return 0, await anext(self._single)
        except StopAsyncIteration:
            return 0, _STREAM_END
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return 0, exc

    async def __anext__(self) -> tuple[int, GenerateOutput]:
        while self._open_streams:
            index, item = await self._next_item()
            rid = self._inputs[index].rid
            if item is _STREAM_END:
                self._open_streams -= 1
                if rid in self._unfinished:
                    raise APIError(500, f"The engine ended {rid} without finishing it.", type=SERVER_ERROR)
                continue
            if isinstance(item, InvalidRequest):
                raise APIError(400, str(item), param=item.param)
            if isinstance(item, BaseException):
                logger.error("The engine failed on %s", rid, exc_info=item)
                raise APIError(500, f"The engine failed on this request ({item}).", type=SERVER_ERROR)
            output = cast(GenerateOutput, item)
            self._record(index, output)
            if output.error is not None and output.rejected:
                raise APIError(400, output.error, param=output.error_param)
            if output.error is not None and output.retry_after_s is not None:  # waited for KV memory in vain
                raise APIError(
                    503,
                    output.error,
                    type=SERVER_ERROR,
                    code="kv_memory_unavailable",
                    headers={"Retry-After": str(max(1, math.ceil(output.retry_after_s)))},
                )
            if output.error is not None:
                raise APIError(
                    500,
                    f"The engine failed on this request: {output.error}",
                    type=SERVER_ERROR,
                    code="engine_error",
                )
            return index, output
        raise StopAsyncIteration

    def _record(self, index: int, output: GenerateOutput) -> None:
        tracker = self._trackers[index]
        tracker.on_tokens(len(output.token_ids))
        if output.finished or output.error is not None:
            self._unfinished.pop(output.rid, None)
            tracker.on_finish(
                output.finish_reason or ("error" if output.error else "stop"),
                prompt_tokens=output.prompt_tokens or len(self._inputs[index].input_ids),
                cached_tokens=output.cached_tokens,
            )

    def close(self) -> None:
        """Abort what has not finished and stop the pumps; synchronous so no cancellation skips it."""
        if self._closed:
            return
        self._closed = True
        for rid, index in list(self._unfinished.items()):
            try:
                self._client.abort(rid)
            except Exception:
                logger.exception("Aborting %s failed", rid)
            self._trackers[index].on_finish("abort", prompt_tokens=len(self._inputs[index].input_ids))
        self._unfinished.clear()
        for task in self._tasks:
            task.cancel()
        self._metrics.in_flight.dec()


async def stream_events(
    prepared: PreparedRequest,
    client: EngineClient,
    metrics: ServerMetrics,
    request: Request,
    response_format: ResponseFormat,
) -> AsyncGenerator[str, None]:
    fan_out = FanOut(client, prepared.inputs, metrics)
    choices = [ChoiceState(prompt_tokens=prepared.prompt_tokens[p]) for p in prepared.prompt_of_choice]
    deltas = TextDeltas(prepared, response_format)
    try:
        for chunk in response_format.opening(prepared):
            yield sse(chunk)
        try:
            async for index, output in fan_out:
                state = choices[index]
                state.absorb(output)
                line = deltas.line(index, output, state)
                if line is not None:
                    yield line
        except APIError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
            yield SSE_DONE
            return
        if prepared.include_usage:
            yield sse(response_format.usage_chunk(prepared, usage_of(prepared, choices)))
        yield SSE_DONE
    finally:
        fan_out.close()


async def collect_response(
    prepared: PreparedRequest,
    client: EngineClient,
    metrics: ServerMetrics,
    request: Request,
    response_format: ResponseFormat,
) -> Response:
    fan_out = FanOut(client, prepared.inputs, metrics)
    choices = [ChoiceState(prompt_tokens=prepared.prompt_tokens[p]) for p in prepared.prompt_of_choice]

    async def run() -> None:
        async for index, output in fan_out:
            choices[index].absorb(output)

    work = asyncio.ensure_future(run())
    client_gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, client_gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            logger.info("Client left before %s finished; aborted it", prepared.request_id)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        work.result()
    finally:
        fan_out.close()
        work.cancel()
        client_gone.cancel()
    body = response_format.response(prepared, choices).model_dump_json()
    return Response(content=body, media_type="application/json")


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(StreamingResponse):
    """Server-sent events whose generator is always closed, even when the client vanishes mid-send."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
