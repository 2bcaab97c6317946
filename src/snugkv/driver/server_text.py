"""The engine process's server side of text: its copy of the tokenizer, and the streams' text.

The server needs its own tokenizer (prompts, chat templates, token-id checks). It loads it on a
thread of its own as soon as the engine process names the model's source (`TokenizerLoad`), while
that process loads the weights and captures its graphs, instead of after "ready".

Holding the tokenizer, the server also makes the text of every stream without stop strings
(`StreamTexts`): the engine sends such a stream's token ids only (`EngineCore.leave_text_downstream`),
and the server's pipe reader moves all of a turn's streams on with one batched decode
(`detokenizer.detokenize_many`, which releases the GIL) before the outputs reach the event loop.
So the engine's scheduler thread, which drives the device, does no detokenizing for them. A stream
with stop strings is detokenized in the engine, where its text decides when it ends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from snugkv.core.outputs import GenerateOutput
from snugkv.core.tokenizer import Tokenizer
from snugkv.driver.engine_core import load_tokenizer_or_none
from snugkv.models.loader import ModelSource
from snugkv.models.tokenizer import Tokenizer as LoadedTokenizer
from snugkv.scheduler.detokenizer import detokenize, detokenize_many

logger = logging.getLogger(__name__)

WHOSE = "the server's"


class TokenizerLoad:
    """The server's copy of the tokenizer, loading on a thread from `start` until `result`."""

    def __init__(self) -> None:
        self._source: ModelSource | None = None
        self._loaded: LoadedTokenizer | None = None
        self._finished = False  # the thread loaded `_source`'s tokenizer, or found it has none
        self._thread: threading.Thread | None = None

    def start(self, source: ModelSource) -> None:
        """Begin loading `source`'s tokenizer (the engine process named it; it is still starting)."""
        self._source = source
        self._thread = threading.Thread(
            target=self._load, args=(source,), name="snugkv-tokenizer-load", daemon=True
        )
        self._thread.start()

    def _load(self, source: ModelSource) -> None:
        try:  # a model without one: the engine process says so (one warning line, not two)
            self._loaded, _ = load_tokenizer_or_none(source, warn=True, whose=WHOSE, warn_missing=False)
            self._finished = True
        except Exception:  # loaded again in `result`, where its error reaches the caller
            logger.debug("loading the tokenizer ahead of the engine failed", exc_info=True)

    def result(self, source: ModelSource, eos_token_ids: tuple[int, ...]) -> LoadedTokenizer | None:
        """The tokenizer of `source` with the model's EOS ids (None: the model ships none); loaded
        now if the thread loaded another source or failed."""
        if self._thread is not None:
            self._thread.join()
        if self._source == source and self._finished:
            return None if self._loaded is None else self._loaded.with_eos_token_ids(eos_token_ids)
        tokenizer, _ = load_tokenizer_or_none(
            source, eos_token_ids, warn=True, whose=WHOSE, warn_missing=False
        )
        return tokenizer


@dataclass(slots=True)
class TextStream:
    """One stream's detokenizing state (a `detokenizer.TextState`): the ids from the window's start
    on (older ones are dropped), and the text of the last turn."""

    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def take_text(self) -> str:
        """The text the last `detokenize` added; forgets the ids before the window."""
        text, self.text = self.text, ""
        if self.prefix_offset:
            del self.output_ids[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        return text


class StreamTexts:
    """The text of the streams the engine leaves to the server, by request id. `open` runs on the
    event loop before the request is sent; `fill` on the pipe reader, once per engine turn."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._streams: dict[str, TextStream] = {}
        self._lock = threading.Lock()

    def open(self, rid: str) -> None:
        with self._lock:
            self._streams[rid] = TextStream()

    def close(self, rid: str) -> None:
        with self._lock:
            self._streams.pop(rid, None)

    def clear(self) -> None:
        with self._lock:
            self._streams.clear()

    def fill(self, outputs: Sequence[GenerateOutput]) -> list[str]:
        """Give each output of a stream opened here the text its tokens add (one batched decode per
        round: a message that merged several turns holds a stream's outputs in order, one per
        round); returns the ids of requests whose tokens the tokenizer could not decode: their
        output is now an error, and the engine should be told to abort them."""
        rounds: list[list[GenerateOutput]] = []
        seen: dict[str, int] = {}
        for output in outputs:
            index = seen.get(output.rid, 0)
            seen[output.rid] = index + 1
            if index == len(rounds):
                rounds.append([])
            rounds[index].append(output)
        return [rid for outputs_of_round in rounds for rid in self._fill_round(outputs_of_round)]

    def _fill_round(self, outputs: Sequence[GenerateOutput]) -> list[str]:
        moved: list[tuple[TextStream, GenerateOutput]] = []
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.rid)
                if stream is None:
                    continue
                if output.finished:
                    del self._streams[output.rid]
                if output.error is None:  # a failed request's tokens may be what broke the tokenizer
                    stream.output_ids.extend(output.token_ids)
                    moved.append((stream, output))
        if not moved:
            return []
        finals = [output.finished for _, output in moved]
        try:
            detokenize_many(self.tokenizer, [stream for stream, _ in moved], finals)
        except Exception:  # one stream's tokens: find it, end it, and give the others their text
            return self._fill_one_by_one(moved)
        for stream, output in moved:
            output.text = stream.take_text()
        return []

    def _fill_one_by_one(self, moved: list[tuple[TextStream, GenerateOutput]]) -> list[str]:
        failed = []
        for stream, output in moved:
            try:
                detokenize(self.tokenizer, stream, final=output.finished)
            except Exception as exc:
                output.text = ""
                output.finished, output.finish_reason = True, "error"
                output.error = f"the tokenizer could not decode the output ({type(exc).__name__}: {exc})"
                self.close(output.rid)
                failed.append(output.rid)
                continue
            output.text = stream.take_text()
        return failed
