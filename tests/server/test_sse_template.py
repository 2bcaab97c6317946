"""Text-only SSE chunks come from a per-choice template; every line must be the very line the
response format itself writes, whatever the text holds."""

from __future__ import annotations

import pytest

from snugkv.core.outputs import GenerateOutput, TokenLogprob
from snugkv.server.formats import ChatFormat, ChoiceState, CompletionFormat
from snugkv.server.prepare import PreparedRequest
from snugkv.server.sse import TextDeltas, sse

TEXTS = [
    " hello",
    'quote " and \\ back',
    "line\nbreak\ttab\r",
    "\x00\x01\x1f\x7f",
    "é 世界 🙂",
    "\u2028\u2029",
    "</s>",
]


def _prepared(logprobs: bool = False, choices: int = 2) -> PreparedRequest:
    return PreparedRequest("cmpl-1", 7, "m", [], list(range(choices)), [3] * choices, True, False, logprobs)


def _output(text: str, **fields) -> GenerateOutput:
    return GenerateOutput(rid="r", token_ids=[1], text=text, **fields)


@pytest.mark.parametrize("response_format", [CompletionFormat(), ChatFormat()], ids=["completion", "chat"])
def test_every_line_is_the_formats_own(response_format):
    prepared = _prepared()
    deltas = TextDeltas(prepared, response_format)
    for index in (0, 1):
        state = ChoiceState(prompt_tokens=3)
        for text in [*TEXTS, *TEXTS]:  # the first chunk makes the frame, the rest use it
            output = _output(text)
            state.absorb(output)
            assert deltas.line(index, output, state) == sse(
                response_format.delta(prepared, index, output, state)
            )
        assert deltas._frames[index] is not None  # the template was taken, not the slow way each time
        last = _output("end", finished=True, finish_reason="length")
        state.absorb(last)
        line = deltas.line(index, last, state)
        assert line == sse(response_format.delta(prepared, index, last, state)) and '"length"' in line


@pytest.mark.parametrize("response_format", [CompletionFormat(), ChatFormat()], ids=["completion", "chat"])
def test_logprobs_and_empty_text_take_the_formats_way(response_format):
    prepared = _prepared(logprobs=True)
    deltas = TextDeltas(prepared, response_format)
    state = ChoiceState(prompt_tokens=3)
    entry = TokenLogprob(token_id=1, token="a", logprob=-0.5, top=[("a", -0.5)])
    output = _output("a", logprobs=[entry])
    state.absorb(output)
    line = deltas.line(0, output, state)
    assert line == sse(response_format.delta(prepared, 0, output, state)) and "-0.5" in line
    assert deltas._frames == {}
    assert TextDeltas(_prepared(), response_format).line(0, _output(""), ChoiceState(prompt_tokens=3)) is None


class ShoutingFormat(CompletionFormat):
    """A format whose delta changes the text but claims plain deltas: the check must catch it."""

    def delta(self, prepared, index, output, state):  # type: ignore[no-untyped-def]
        chunk = super().delta(prepared, index, output, state)
        if chunk is not None:
            chunk.choices[0].text = output.text.upper()
        return chunk


def test_a_frame_that_disagrees_with_the_format_is_never_used():
    response_format = ShoutingFormat()
    prepared = _prepared()
    deltas = TextDeltas(prepared, response_format)
    state = ChoiceState(prompt_tokens=3)
    for text in ("abc", "def"):
        output = _output(text)
        assert text.upper() in deltas.line(0, output, state)
    assert deltas._frames == {0: None}


def test_the_tool_call_format_never_takes_the_text_template():
    from snugkv.server.formats import ChatFormat
    from snugkv.server.tool_format import ToolCallFormat

    assert ChatFormat.plain_text_deltas and not ToolCallFormat.plain_text_deltas
