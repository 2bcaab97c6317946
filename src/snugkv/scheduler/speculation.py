"""Speculative decoding's policy in the scheduler: which decode steps speculate, each row's draft,
and the counts of what was proposed and accepted (issue 34; docs/SPECULATIVE.md).

A decode step speculates when speculation is on (`--speculative ngram|suffix`), at most
`max_batch_size` requests run, and some row may draft: it has no grammar (structured output's
masks would have to follow the draft token by token), its recent acceptance has not paused it
(`RowDrafter`), and it may still emit two tokens or more (`max_new_tokens`, the context). Such a
step runs each row with a draft as its last token plus the draft, and the runner verifies instead
of sampling (`ModelRunner.verify_on_device`); rows without a draft in it are sampled through the
same verification (k = 0). A step that does not speculate is an ordinary decode step. A host
proposer drafts behind a step still in flight too: a row whose last token that step computes
drafts from the tokens before it, past the proposer's guess of that token (`drafts`), so the
verify step is launched before the step in flight is read (docs/SPECULATIVE.md, item 7).

Each request gets a `RowDrafter` at its first decode step that may speculate; with the suffix
method every drafter reads one `SuffixStore` of this scheduler, which a request's output joins
when it ends by a stop or its length.

With `--speculative draft` no host proposer drafts: a row's draft is `room` placeholders
(`DRAFT_PENDING`) when the step is scheduled, so that the slots of every position are allocated
with the step's, and at launch `draft_on_device` asks the runner for the draft model's forwards
(snugkv.runner.draft_steps), which write their KV into those slots, and puts the tokens in place of
the placeholders; the probabilities of sampled rows go to verification. The back-off is the same.
This module never allocates or frees slots and never touches the queues.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from snugkv.runner.draft_steps import DraftRow
from snugkv.scheduler.launched import ScheduledBatch
from snugkv.scheduler.request import Request
from snugkv.speculative.config import SpeculativeConfig
from snugkv.speculative.drafter import RowDrafter
from snugkv.speculative.suffix import SuffixStore

if TYPE_CHECKING:
    from snugkv.runner.model_runner import ModelRunner

DRAFT_PENDING = -2  # a draft model's token until its forwards run at launch (never fed to a forward)


@dataclass(slots=True)
class SpeculationCounts:
    """Totals since start: draft tokens the target judged, those it kept, and the rows that had a
    draft in a verify step (each emitted its accepted tokens plus one)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafted_rows: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafted row emitted per verify step (accepted + 1); 0.0 before any."""
        return 1.0 + self.accepted_tokens / self.drafted_rows if self.drafted_rows else 0.0


class Speculation:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.store = SuffixStore() if config.method == "suffix" else None
        self.counts = SpeculationCounts()

    @property
    def drafts_in_flight(self) -> bool:
        """Whether a row drafts while its last token is still on the device (a host proposer
        guesses it); a draft model needs the token itself, so its steps read the step before."""
        return not self.config.drafts_with_model

    def may_speculate(self, requests: Sequence[Request], context_length: int) -> bool:
        """Whether a decode step of `requests` should try drafts (a verify step is read at once)."""
        if len(requests) > self.config.max_batch_size:
            return False
        return any(self._draft_room(request, context_length) > 0 for request in requests)

    def drafts(self, requests: Sequence[Request], context_length: int) -> list[list[int]]:
        """Each request's draft for this step (empty where it drafts nothing). A request whose last
        token a step in flight is still computing (`in_flight`) drafts from the tokens before it
        with a host proposer (`RowDrafter.propose`'s `unread`: the proposer's guess of that token
        is dropped, the draft follows it), and not at all with a draft model."""
        drafts: list[list[int]] = []
        for request in requests:
            unread = _unread(request)
            room = 0 if unread and not self.drafts_in_flight else self._draft_room(request, context_length)
            drafter = self._drafter(request) if room > 0 else None
            if drafter is None:
                drafts.append([])
            elif self.config.drafts_with_model:
                drafts.append([DRAFT_PENDING] * room)
            else:
                drafts.append(drafter.propose(request.all_ids, room, unread))
        return drafts

    def draft_on_device(self, runner: ModelRunner, scheduled: ScheduledBatch) -> torch.Tensor | None:
        """A verify step about to launch with `--speculative draft`: run the draft model for its rows
        that draft (their slots are allocated), put the tokens in `scheduled.drafts` and its rows in
        place of the placeholders, and return the drafts' probabilities for verification (None when
        every drafting row is greedy, or when a host proposer drafted)."""
        drafts = scheduled.drafts
        if not self.config.drafts_with_model or drafts is None:
            return None
        drafting_model = runner.model
        separate = self.config.separate_draft
        if separate:
            if runner.draft_model is None:
                raise ValueError(
                    f"--draft-model {self.config.draft_model}: this engine was started without it (a "
                    "separate draft model is loaded at start-up, its KV beside the model's)"
                )
            drafting_model = runner.draft_model
        drafting = [index for index, draft in enumerate(drafts) if draft]
        rows, requests = scheduled.rows, scheduled.requests
        result = runner.draft_on_device(
            [
                DraftRow(rows[i].req_pool_idx, rows[i].prefix_len, rows[i].token_ids[0], len(drafts[i]))
                for i in drafting
            ],
            [requests[i].sampling for i in drafting],
            [requests[i].generator for i in drafting],
            self.config.draft_layers(drafting_model.config.num_layers),
            separate=separate,
        )
        for index, tokens in zip(drafting, result.token_ids):
            drafts[index][:] = tokens
            rows[index].token_ids = [rows[index].token_ids[0], *tokens]
        return result.probs

    def record(self, request: Request, draft_tokens: int, accepted_tokens: int) -> None:
        """A verify step judged `draft_tokens` of `request`'s draft and kept `accepted_tokens`."""
        if draft_tokens <= 0 or request.drafter is None:
            return
        request.drafter.record(draft_tokens, accepted_tokens, request.num_tokens)
        self.counts.draft_tokens += draft_tokens
        self.counts.accepted_tokens += accepted_tokens
        self.counts.drafted_rows += 1

    def finish(self, request: Request, reason: str) -> None:
        """`request` ended: its output joins the suffix store if it ended as the model meant it to."""
        if request.drafter is not None and reason in ("stop", "length"):
            request.drafter.finish()

    def _draft_room(self, request: Request, context_length: int) -> int:
        """The longest draft worth verifying for `request` now: every emitted token (the draft's and
        the one after, behind the token a step in flight computes) must fit in its
        `max_new_tokens` and the context."""
        if request.grammar is not None:
            return 0
        num_tokens = request.num_tokens + _unread(request)
        drafter = request.drafter
        if drafter is not None and not drafter.may_draft(num_tokens):
            return 0
        generated = num_tokens - len(request.prompt_ids)
        left = min(request.sampling.max_new_tokens - generated, context_length - num_tokens)
        return min(self.config.num_tokens, left - 1)

    def _drafter(self, request: Request) -> RowDrafter:
        if request.drafter is None:
            request.drafter = RowDrafter(self.config, request.all_ids, self.store)
        return request.drafter


def _unread(request: Request) -> int:
    """Tokens of `request` a step in flight is computing: its next token (1), or none (0). A verify
    step, whose count varies, is always read before the next step is scheduled."""
    return 1 if request.in_flight else 0
