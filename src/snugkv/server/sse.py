"""The server-sent event lines of a streamed answer; the common chunk from a template.

Almost every chunk of a stream is a text-only delta (no logprobs, not the last): the same JSON
frame around a different text. Building the pydantic chunk and dumping it costs tens of
microseconds, once per request per step, on the event loop that the scheduler thread shares the
GIL with. `TextDeltas` dumps the frame once per choice, from the format's own `delta` (a probe
text marks where the text goes), checks it against the format's own line for the first real chunk,
and from then on writes the text into the frame. A format opts in with `plain_text_deltas = True`
(its `delta` of such an output must not depend on anything but the text); anything else, and
every other chunk, goes through the format as before.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from snugkv.core.outputs import GenerateOutput
from snugkv.server.formats import ChoiceState, ResponseFormat
from snugkv.server.prepare import PreparedRequest

PROBE = "snugkv-text-probe-7d1f3a"
SSE_DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def text_json(text: str) -> str:
    """`text` as a JSON string, written as pydantic writes it (UTF-8 as is, controls escaped)."""
    return json.dumps(text, ensure_ascii=False)


class TextDeltas:
    """The SSE line of each delta of one streamed request's choices."""

    def __init__(self, prepared: PreparedRequest, response_format: ResponseFormat) -> None:
        self._prepared = prepared
        self._format = response_format
        self._enabled = bool(getattr(response_format, "plain_text_deltas", False)) and not prepared.logprobs
        self._frames: dict[int, tuple[str, str] | None] = {}  # None: this choice takes the slow way

    def line(self, index: int, output: GenerateOutput, state: ChoiceState) -> str | None:
        """The line for `output` of choice `index` (already absorbed into `state`); None: nothing to send."""
        plain = (
            self._enabled
            and output.text
            and not output.finished
            and not output.logprobs
            and output.error is None
            and state.finish_reason is None
        )
        made = index in self._frames
        frame = self._frames.get(index) if plain else None
        if frame is not None:
            return frame[0] + text_json(output.text) + frame[1]
        delta = self._format.delta(self._prepared, index, output, state)
        line = None if delta is None else sse(delta)
        if plain and not made:  # this choice's first plain chunk: make the frame, keep it if it agrees
            candidate = self._frame(index)
            agrees = candidate is not None and line == candidate[0] + text_json(output.text) + candidate[1]
            self._frames[index] = candidate if agrees else None
        return line

    def _frame(self, index: int) -> tuple[str, str] | None:
        probe = GenerateOutput(rid="probe", token_ids=[], text=PROBE)
        delta = self._format.delta(self._prepared, index, probe, ChoiceState(prompt_tokens=0))
        if delta is None:
            return None
        parts = sse(delta).split(text_json(PROBE))
        return (parts[0], parts[1]) if len(parts) == 2 else None
