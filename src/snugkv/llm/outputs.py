"""What `LLM` hands back, and how it gathers it from the scheduler's output stream.

`RequestOutput` is one prompt's whole result, its `CompletionOutput`s in `outputs` (vLLM's shape;
`memory()`'s report is `core.reports.MemoryReport`). `Collector` is the scheduler's `on_output` callback:
it appends each request's increments (tokens, text, log-probabilities) and keeps the final one.
`Progress` is the tqdm bar of a long call. None of them touches the scheduler's state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from snugkv.core.outputs import FinishReason, GenerateOutput, TokenLogprob
from snugkv.scheduler.request import Request


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """When a request was queued, got its first token and finished (`time.monotonic()` seconds)."""

    arrival_s: float
    first_token_s: float
    finished_s: float

    @property
    def time_to_first_token_s(self) -> float:
        return self.first_token_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One completion of a prompt, as vLLM's `CompletionOutput`: `index` among the prompt's `n`,
    its `text`, `token_ids`, `finish_reason` ("stop", "length", "abort", ...), `logprobs` (one entry
    per token when asked; each is also vLLM's `{token_id: Logprob}`) and `cumulative_logprob`.
    With speculative decoding on (`speculative="ngram"` or `"suffix"`), `draft_tokens` counts the
    draft tokens the model judged for it and `accepted_draft_tokens` those it kept (None and 0: off)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] | None
    times: RequestTimes
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    draft_tokens: int | None = None
    accepted_draft_tokens: int = 0

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the tokens' log-probabilities (None unless `logprobs` was asked, as in vLLM)."""
        return None if self.logprobs is None else sum(entry.logprob for entry in self.logprobs)

    @property
    def stop_reason(self) -> None:
        """vLLM's stop string or token that ended the text; not tracked here."""
        return None

    def finished(self) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One prompt's result, as vLLM's `RequestOutput`: `request_id`, `prompt` (the text given; None
    for token ids and chats), `prompt_token_ids`, `prompt_logprobs` (one entry per prompt token,
    the first None, when `SamplingParams.prompt_logprobs` asked) and `outputs`, its `n`
    completions. `text`, `token_ids`, `finish_reason`, `logprobs`, `cached_tokens` and `times` are
    the first completion's (snugkv's own names from before `n`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finished: bool = True

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    @property
    def cached_tokens(self) -> int:
        return self.outputs[0].cached_tokens

    @property
    def times(self) -> RequestTimes:
        return self.outputs[0].times

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(output.token_ids) for output in self.outputs)


@dataclass(slots=True)
class Stream:
    """One request's output so far."""

    token_ids: list[int] = field(default_factory=list)
    text_pieces: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    final: GenerateOutput | None = None
    times: RequestTimes | None = None


class Collector:
    """The scheduler's `on_output` callback: the streams of the requests of the call in progress."""

    def __init__(self) -> None:
        self.streams: dict[str, Stream] = {}
        self.output_tokens = 0
        self.finished = 0

    def expect(self, rids: list[str]) -> None:
        self.streams = {rid: Stream() for rid in rids}
        self.output_tokens = self.finished = 0

    def on_output(self, request: Request, output: GenerateOutput) -> None:
        stream = self.streams.get(output.rid)
        if stream is None:
            return
        stream.token_ids.extend(output.token_ids)
        if output.text:
            stream.text_pieces.append(output.text)
        stream.logprobs.extend(output.logprobs)
        if output.prompt_logprobs is not None:
            stream.prompt_logprobs = output.prompt_logprobs
        self.output_tokens += len(output.token_ids)
        if output.finished:
            now = time.monotonic()
            stream.final = output
            stream.times = RequestTimes(request.arrival_s, request.first_token_s or now, now)
            self.finished += 1


class Progress:
    """A tqdm bar over finished prompts with the output tokens/s so far. It appears only once a
    call has run for a second, so short calls print nothing."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Any = None
        if enabled and total:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc="Processed prompts", unit="prompt", delay=1.0, dynamic_ncols=True
            )
        self._started = time.perf_counter()
        self._shown_finished = 0
        self._shown_at = 0.0

    def update(self, collector: Collector) -> None:
        if self._bar is None:
            return
        if collector.finished > self._shown_finished:
            self._bar.update(collector.finished - self._shown_finished)
            self._shown_finished = collector.finished
        now = time.perf_counter()
        if now - self._shown_at >= 0.5:
            rate = collector.output_tokens / max(now - self._started, 1e-9)
            self._bar.set_postfix_str(f"output {rate:,.0f} tok/s", refresh=False)
            self._shown_at = now

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
