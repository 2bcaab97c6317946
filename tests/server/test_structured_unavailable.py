"""Without xgrammar installed, a request that asks for structured output or a forced tool call is a
400 saying to install it, from the server's checks and from the scheduler's alike (no server)."""

from __future__ import annotations

import sys

import pytest

from snugkv.core.sampling import InvalidRequest
from snugkv.core.structured_output import StructuredOutput
from snugkv.server.errors import APIError
from snugkv.server.guided import requested_structured_output
from snugkv.server.protocol import ChatCompletionRequest, CompletionRequest
from snugkv.server.tools import plan_tools
from snugkv.structured.grammars import GrammarCache


@pytest.fixture()
def no_xgrammar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError


@pytest.mark.parametrize(
    "fields",
    [{"guided_regex": "[0-9]+"}, {"response_format": {"type": "json_object"}}, {"guided_choice": ["a", "b"]}],
)
def test_structured_output_without_xgrammar_is_a_400_saying_to_install_it(no_xgrammar, fields) -> None:
    with pytest.raises(APIError) as raised:
        requested_structured_output(CompletionRequest(prompt="x", **fields))
    assert raised.value.status_code == 400
    assert "xgrammar" in str(raised.value.message) and "pip install" in str(raised.value.message)


def test_plain_requests_and_plain_tools_need_no_xgrammar(no_xgrammar) -> None:
    assert requested_structured_output(CompletionRequest(prompt="x")) is None
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert plan_tools(tools, "auto", None) is not None
    with pytest.raises(APIError, match="xgrammar"):
        plan_tools(tools, "required", None)
    assert ChatCompletionRequest(messages=[], tools=tools).tools == tools


def test_the_scheduler_refuses_too(no_xgrammar) -> None:
    with pytest.raises(InvalidRequest, match="pip install"):
        GrammarCache(object(), 100, [0]).get(StructuredOutput("regex", "a"))
