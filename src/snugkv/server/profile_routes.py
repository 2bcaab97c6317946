"""HTTP routes of the step profiler (driver.profiling), the names vLLM and SGLang use:

    POST /start_profile  optional body {"output_dir": "...", "num_steps": N}: record the engine's next
                         steps (N of them, or until stopped) with the torch profiler
    POST /stop_profile   end it: {"trace_path", "steps", "seconds", "summary"} (where the device time
                         went, by kind of kernel, and the busiest kernels: core.profiles)

A profile that runs already, or none that could stop, is a 409; a bad field a 400. The trace is
written by the engine's process, on its machine, under the profile folder ($SNUGKV_PROFILE_DIR when
the server starts, else <tmp>/snugkv-profile): `output_dir` names a folder inside it, never one
elsewhere (a client picks no path on the server's disk). Behind the API key like every route.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from snugkv.core.engine_client import EngineClient
from snugkv.core.profiles import PROFILE_DIR_ENV, ProfileError, default_profile_dir
from snugkv.server.elastic_routes import json_body, json_object
from snugkv.server.errors import APIError

START_EXAMPLE = '{"num_steps": 20} or {"output_dir": "/tmp/profiles"}'


def _profile_error(exc: ProfileError) -> APIError:
    return APIError(exc.status, str(exc), code="profile_refused")


def install_profile_routes(app: FastAPI, client: EngineClient) -> None:
    @app.post(
        "/start_profile",
        openapi_extra=json_body({"output_dir": {"type": "string"}, "num_steps": {"type": "integer"}}),
    )
    async def start_profile(request: Request) -> Any:
        body = await json_object(request, START_EXAMPLE) if (await request.body()).strip() else {}
        unknown = sorted(set(body) - {"output_dir", "num_steps"})
        if unknown:
            raise APIError(
                400, f"Unknown field(s) {', '.join(unknown)}; send {START_EXAMPLE}.", param=unknown[0]
            )
        output_dir, num_steps = body.get("output_dir"), body.get("num_steps")
        if output_dir is not None and not isinstance(output_dir, str):
            raise APIError(400, f"output_dir must be a string; send {START_EXAMPLE}.", param="output_dir")
        if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int)):
            raise APIError(400, f"num_steps must be an integer; send {START_EXAMPLE}.", param="num_steps")
        root = default_profile_dir().resolve()
        target = (root / output_dir).resolve() if output_dir else root
        if not target.is_relative_to(root):  # a client writes traces under the profile folder only
            raise APIError(
                400,
                f"output_dir must lie inside the profile folder {root} (set by {PROFILE_DIR_ENV} when the "
                "server starts); give a folder name under it, or none.",
                param="output_dir",
            )
        try:
            folder = await client.start_profile(output_dir=str(target), num_steps=num_steps)
        except ProfileError as exc:
            raise _profile_error(exc) from exc
        steps = f"the next {num_steps} steps" if num_steps else "every step until POST /stop_profile"
        return {"message": f"Profiling {steps}; the trace goes to {folder}.", "output_dir": folder}

    @app.post("/stop_profile")
    async def stop_profile() -> Any:
        try:
            report = await client.stop_profile()
        except ProfileError as exc:
            raise _profile_error(exc) from exc
        return report.to_dict()
