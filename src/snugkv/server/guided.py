"""The request fields that ask for structured output, turned into one `StructuredOutput`.

OpenAI's `response_format` (`json_object`, `json_schema` with its `schema`), vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and SGLang's `json_schema`, `regex`, `ebnf`. A
request may ask for one constraint; a spec that cannot compile is a 400 naming the problem, and so
is one that needs xgrammar where it is not installed. Never compiles for a tokenizer (the engine's
grammar cache does).
"""

from __future__ import annotations

import json
from typing import Any

from snugkv.core.sampling import InvalidRequest
from snugkv.core.structured_output import StructuredOutput
from snugkv.server.errors import bad_request
from snugkv.server.protocol import GenerationRequest
from snugkv.structured.grammars import check_structured_output


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise bad_request(
                f"{param} is not valid JSON ({exc.msg}); send a JSON schema.", param=param
            ) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON schema object.", param=param)
    return json.dumps(schema)  # key order kept: the output's properties follow the schema's order


def _response_format(value: dict[str, Any]) -> StructuredOutput | None:
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}.',
                param="response_format",
            )
        # `strict` is not read: the schema is enforced either way (strict: false promises less, and
        # an output that keeps to the schema breaks no promise), as the README says.
        return StructuredOutput(
            "json_schema", _schema_text(spec["schema"], "response_format.json_schema.schema")
        )
    raise bad_request(
        f"response_format type {kind!r} is not supported; use text, json_object or json_schema.",
        param="response_format",
    )


def requested_structured_output(body: GenerationRequest) -> StructuredOutput | None:
    """The constraint `body` asks for (None: none), checked; a 400 names what to change."""
    asked: list[tuple[str, StructuredOutput]] = []
    if body.response_format is not None:
        output = _response_format(body.response_format)
        if output is not None:
            asked.append(("response_format", output))
    for name in ("guided_json", "json_schema"):
        value = getattr(body, name)
        if value is not None:
            asked.append((name, StructuredOutput("json_schema", _schema_text(value, name))))
    for name in ("guided_regex", "regex"):
        value = getattr(body, name)
        if value is not None:
            asked.append((name, StructuredOutput("regex", value)))
    for name in ("guided_grammar", "ebnf"):
        value = getattr(body, name)
        if value is not None:
            asked.append((name, StructuredOutput("grammar", value)))
    if body.guided_choice is not None:
        asked.append(("guided_choice", StructuredOutput("choice", json.dumps(body.guided_choice))))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise bad_request(f"Ask for one structured output at a time, not {names}.", param=asked[1][0])
    name, output = asked[0]
    check(output, name)
    return output


def check(output: StructuredOutput, param: str) -> None:
    """A 400 naming the problem if `output` cannot compile (or xgrammar is missing)."""
    try:
        check_structured_output(output)
    except InvalidRequest as exc:
        raise bad_request(f"{param}: {exc}.", param=param) from None
