"""The app's OpenAPI schema (GET /openapi.json): FastAPI's, with the request bodies the
generation routes parse themselves.

The generation routes read their body by hand (`prepare.parse_body`), so that every error keeps
this server's wording; FastAPI therefore cannot see their request models. This module puts
`CompletionRequest` and `ChatCompletionRequest` into the schema as those routes' bodies, with the
informational fields listed and no other undeclared field allowed (any other is a 400, see
`protocol.unrecognized_field`), so that a client generator or a fuzzer (schemathesis, in
tests/server/test_fuzz.py) reads what the server takes. It describes; it never validates.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from snugkv.server.protocol import INFORMATIONAL_FIELDS, ChatCompletionRequest, CompletionRequest

REF_TEMPLATE = "#/components/schemas/{model}"

# route -> the model its body is parsed into
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """The `requestBody` of a route that parses `model` from JSON."""
    ref = {"$ref": REF_TEMPLATE.format(model=model.__name__)}
    return {"required": True, "content": {"application/json": {"schema": ref}}}


def install_openapi(app: FastAPI) -> None:
    """Serve the schema with the generation routes' request models, built once on first use."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in REQUEST_BODIES.values():
                components.update(_model_schemas(model))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _model_schemas(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema and the models it refers to, as components."""
    schema = model.model_json_schema(ref_template=REF_TEMPLATE)
    nested = schema.pop("$defs", {})
    properties = schema.setdefault("properties", {})
    for name in sorted(INFORMATIONAL_FIELDS):
        properties.setdefault(name, {"description": "informational: accepted, changes nothing"})
    schema["additionalProperties"] = False
    return {**nested, model.__name__: schema}
