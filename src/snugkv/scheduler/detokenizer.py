"""Incremental detokenization: new text per step without decoding the whole output again.

Text is emitted only once it is stable: a byte-level BPE token can end in the middle of a UTF-8
character (decoded as U+FFFD), so such text waits for the next token. Each step decodes a short
window `[prefix_offset:]` of the output, not all of it.
"""

from __future__ import annotations

from snugkv.core.tokenizer import Tokenizer
from snugkv.scheduler.request import Request


def _decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


def detokenize(tokenizer: Tokenizer | None, request: Request, final: bool = False) -> None:
    """Append the newly stable text of `request.output_ids` to `request.text`."""
    ids = request.output_ids
    if tokenizer is None or request.read_offset >= len(ids):
        return
    before = _decode(tokenizer, ids[request.prefix_offset : request.read_offset])
    after = _decode(tokenizer, ids[request.prefix_offset :])
    if len(after) > len(before) and (final or not after.endswith("\ufffd")):
        request.text += after[len(before) :]
        request.prefix_offset = request.read_offset
        request.read_offset = len(ids)


def find_stop(text: str, stops: tuple[str, ...], searched_from: int) -> int | None:
    """Index where the first stop string starts in `text`, looking only at new text."""
    best = None
    for stop in stops:
        index = text.find(stop, max(0, searched_from - len(stop) + 1))
        if index != -1 and (best is None or index < best):
            best = index
    return best
