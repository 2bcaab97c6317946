"""Incremental detokenization: new text per step without decoding the whole output again.

Text is emitted only once it is stable: a byte-level BPE token can end in the middle of a UTF-8
character (decoded as U+FFFD), so such text waits for the next token. Each step decodes a short
window `[prefix_offset:]` of the output, not all of it.

`detokenize` moves one request on (the scheduler, for a request with stop strings: it must see the
text before it decides the next step); `detokenize_many` moves many streams on with one batched
decode (the engine process's server, for every stream the engine leaves to it: the tokenizer's
batch call releases the GIL and does not run on the thread that drives the device). Both follow
the same rule (`_advance`), so a stream's text is the same whichever decodes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from snugkv.core.tokenizer import Tokenizer


class TextState(Protocol):
    """What incremental detokenizing reads and moves on: a stream's ids and the text made so far
    (`Request` is one; the server keeps one per stream it detokenizes)."""

    output_ids: list[int]
    text: str
    prefix_offset: int
    read_offset: int


def _decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


def _advance(state: TextState, before: str, after: str, final: bool) -> None:
    """Append what `after` (the window up to the newest token) adds to `before` (the window up to
    the last stable point), once it no longer ends inside a character (or the stream ended)."""
    if len(after) > len(before) and (final or not after.endswith("\ufffd")):
        state.text += after[len(before) :]
        state.prefix_offset = state.read_offset
        state.read_offset = len(state.output_ids)


def detokenize(tokenizer: Tokenizer | None, request: TextState, final: bool = False) -> None:
    """Append the newly stable text of `request.output_ids` to `request.text`."""
    ids = request.output_ids
    if tokenizer is None or request.read_offset >= len(ids):
        return
    before = _decode(tokenizer, ids[request.prefix_offset : request.read_offset])
    after = _decode(tokenizer, ids[request.prefix_offset :])
    _advance(request, before, after, final)


def detokenize_many(tokenizer: Tokenizer, states: Sequence[TextState], finals: Sequence[bool]) -> None:
    """`detokenize` for every state at once (`finals[i]`: state i's stream ended): one batched
    decode of both windows of every state that has new tokens."""
    moved = [
        (state, final) for state, final in zip(states, finals) if state.read_offset < len(state.output_ids)
    ]
    if not moved:
        return
    windows: list[list[int]] = []
    for state, _ in moved:
        ids = state.output_ids
        windows.append(ids[state.prefix_offset : state.read_offset])
        windows.append(ids[state.prefix_offset :])
    texts = tokenizer.decode_batch(windows, skip_special_tokens=True)
    for index, (state, final) in enumerate(moved):
        _advance(state, texts[2 * index], texts[2 * index + 1], final)


def find_stop(text: str, stops: tuple[str, ...], searched_from: int) -> int | None:
    """Index where the first stop string starts in `text`, looking only at new text."""
    best = None
    for stop in stops:
        index = text.find(stop, max(0, searched_from - len(stop) + 1))
        if index != -1 and (best is None or index < best):
            best = index
    return best
