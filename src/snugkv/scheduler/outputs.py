"""What leaves the scheduler: per-token log-probabilities and the incremental `GenerateOutput`s.

Text is detokenized incrementally and held back while a stop string could still be forming;
each output carries only what was added since the previous one. With `text_downstream` set (the
engine process: its server detokenizes), a request without stop strings gets no text here, only
its token ids: the text of such streams is made on the receiving side, off the thread that drives
the device (`detokenizer.detokenize_many`). The builder never changes a request's slots or its
place in the queues.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from snugkv.core.outputs import GenerateOutput, TokenLogprob
from snugkv.core.tokenizer import Tokenizer
from snugkv.core.transfer import to_device
from snugkv.scheduler.detokenizer import detokenize
from snugkv.scheduler.request import Request

OutputCallback = Callable[[Request, GenerateOutput], None]


class OutputBuilder:
    def __init__(self, tokenizer: Tokenizer | None = None, on_output: OutputCallback | None = None) -> None:
        self.tokenizer = tokenizer
        self.on_output = on_output
        self.text_downstream = False  # requests without stop strings leave without text
        self.reports_drafts = False  # speculation is on: a last output carries the draft counts

    def log_prob_rows(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor | None:
        """Log-probabilities `[rows, vocab]` of the rows whose request asked for them, computed
        where the logits are (queued there: the host does not wait); None if no row asked."""
        wanted = [i for i, request in enumerate(requests) if request.sampling.logprobs is not None]
        if not wanted:
            return None
        index = to_device(wanted, torch.int64, logits.device)
        return torch.log_softmax(logits.index_select(0, index).float(), dim=-1)

    def logprobs(
        self, log_probs: torch.Tensor | None, requests: Sequence[Request], tokens: Sequence[int]
    ) -> list[TokenLogprob | None]:
        """The sampled token's log-probability (and the top alternatives) for every row whose
        request asked for them, from `log_prob_rows` on the host; None for the others and for a
        request that ended while its step ran (that token is never read)."""
        wanted = [i for i, request in enumerate(requests) if request.sampling.logprobs is not None]
        result: list[TokenLogprob | None] = [None] * len(requests)
        if not wanted or log_probs is None:
            return result
        for position, index in enumerate(wanted):
            request, token = requests[index], tokens[index]
            if request.finished:
                continue
            top_n = request.sampling.logprobs or 0
            top = torch.topk(log_probs[position], top_n) if top_n else None
            result[index] = TokenLogprob(
                token_id=int(token),
                token=self.piece(token),
                logprob=float(log_probs[position, token]),
                top=[(self.piece(int(t)), float(v)) for v, t in zip(top.values, top.indices)]
                if top is not None
                else [],
                top_ids=tuple(int(t) for t in top.indices) if top is not None else (),
            )
        return result

    @staticmethod
    def _unsent_prompt_logprobs(request: Request) -> list[Any] | None:
        """The prompt's entries, in the first output after all are computed (None otherwise)."""
        if request.sent_prompt_logprobs or request.sampling.prompt_logprobs is None or request.scores_prompt:
            return None
        request.sent_prompt_logprobs = True
        return list(request.prompt_logprobs)

    def piece(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)

    def emit(self, request: Request) -> None:
        """Send what `request` produced since its last output (nothing without a callback).
        Runs once per request per step: it reads each field once."""
        if self.on_output is None:
            return
        finished = request.finish_reason is not None
        sampling = request.sampling
        text = request.text
        if sampling.stop and not finished:
            holdback = max(len(s) for s in sampling.stop) - 1
            visible = len(text) - holdback
        elif self.text_downstream and not sampling.stop:
            visible = 0
        else:
            # The last text, unless a stop string cut it already or the request failed (its tokens
            # may be what broke the tokenizer: the error must still reach the client).
            if self.tokenizer is not None and not request.stopped_by_string and request.error is None:
                detokenize(self.tokenizer, request, final=finished)
                text = request.text
            visible = len(text)
        output_ids, logprobs = request.output_ids, request.logprobs
        sent_text = request.sent_text_len
        if visible > sent_text:
            new_text, request.sent_text_len = text[sent_text:visible], visible
        else:
            new_text = ""
        output = GenerateOutput(
            rid=request.rid,
            token_ids=output_ids[request.sent_token_len :],
            text=new_text,
            finished=finished,
            finish_reason=request.finish_reason,  # type: ignore[arg-type]
            prompt_tokens=len(request.prompt_ids),
            completion_tokens=len(output_ids),
            cached_tokens=request.cached_tokens,
            logprobs=logprobs[request.sent_logprobs_len :] if logprobs else [],
            prompt_logprobs=None
            if sampling.prompt_logprobs is None
            else self._unsent_prompt_logprobs(request),
            error=request.error,
            retry_after_s=request.retry_after_s,
        )
        if finished and self.reports_drafts:
            drafter = request.drafter
            output.draft_tokens = drafter.proposed_tokens if drafter is not None else 0
            output.accepted_draft_tokens = drafter.accepted_tokens if drafter is not None else 0
        request.sent_token_len = len(output_ids)
        request.sent_logprobs_len = len(logprobs)
        self.on_output(request, output)
