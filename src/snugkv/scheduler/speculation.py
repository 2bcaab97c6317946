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
verify step is launched before the step in flight is read (docs/SPECULATIVE.md, item 7), unless
the rows drafting so guess that token poorly of late (`reads_first`): then the step in flight is
read and the rows draft again from the token itself.

Each request gets a `RowDrafter` at its first decode step that may speculate, or before it: while
a batch is over `max_batch_size` by at most as much again, a few rows a step get theirs behind the
steps in flight (`build_ahead`, only while the device is still busy with the step before: host
work then costs no device time), so that the step where the batch falls to the cap does not build
them all at once on the host with the device waiting; with the suffix method every drafter reads
one `SuffixStore` of this scheduler, which a request's output joins when it ends by a stop or its
length.

With `--speculative draft` no host proposer drafts: a row's draft is `room` placeholders
(`DRAFT_PENDING`) when the step is scheduled, so that the slots of every position are allocated
with the step's, and at launch `draft_on_device` asks the runner for the draft model's forwards
(snugkv.runner.draft_steps), which write their KV into those slots, and puts the tokens in place of
the placeholders; the probabilities of sampled rows go to verification. The back-off is the same.
This module never allocates or frees slots and never touches the queues.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from snugkv.runner.draft_steps import DraftRow
from snugkv.scheduler.launched import ScheduledBatch, StepRecord
from snugkv.scheduler.request import Request
from snugkv.speculative.config import DEFAULT_BREAK_EVEN, SpeculativeConfig
from snugkv.speculative.drafter import RowDrafter
from snugkv.speculative.suffix import SuffixStore

if TYPE_CHECKING:
    from snugkv.runner.model_runner import ModelRunner

DRAFT_PENDING = -2  # a draft model's token until its forwards run at launch (never fed to a forward)
AHEAD_PER_STEP = 4  # drafters `build_ahead` builds behind one step in flight (~0.1-0.5 ms each)
COST_WEIGHT = 0.1  # weight of a new step's time in the running averages


class StepCosts:
    """Running averages, per batch size (1, 2-3, 4-7, ...), of the device time of a plain decode
    step and of a verify step, and of the device's idle time before the step after a verify step
    (the host's work then: a verify step is read before the next step is scheduled), from the
    scheduler's step records. `break_even(rows)`: the accepted draft tokens a row's verify step must
    average so that it emits tokens faster than plain steps would, `(verify + host - decode) /
    decode`: a verify step emits `accepted + 1` tokens in `verify + host`, a plain step one in
    `decode` (its host work hides behind the device)."""

    def __init__(self) -> None:
        self._decode: dict[int, float] = {}
        self._verify: dict[int, float] = {}
        self._host: dict[int, float] = {}
        self._after_verify = False

    def observe(self, record: StepRecord) -> None:
        """One step read back (`StepTimes.records`' newest); prefill steps only end a verify's gap."""
        bucket = record.rows.bit_length()
        if self._after_verify and record.decode and record.gap_s is not None:
            decode = self._decode.get(bucket)
            gap = record.gap_s if decode is None else min(record.gap_s, decode)  # not a stall's
            self._host[bucket] = _average(self._host.get(bucket), gap)
        verify = record.decode and record.tokens > record.rows
        self._after_verify = verify
        if record.decode:
            times = self._verify if verify else self._decode
            times[bucket] = _average(times.get(bucket), record.busy_s)

    def break_even(self, rows: int) -> float:
        """For a step of `rows` rows: `DEFAULT_BREAK_EVEN` until both kinds of step were timed."""
        bucket = rows.bit_length()
        decode, verify = self._decode.get(bucket), self._verify.get(bucket)
        if not decode or verify is None:
            return DEFAULT_BREAK_EVEN
        return max(0.0, (verify + self._host.get(bucket, 0.0) - decode) / decode)


def _average(mean: float | None, value: float) -> float:
    return value if mean is None else (1 - COST_WEIGHT) * mean + COST_WEIGHT * value


@dataclass(slots=True)
class SpeculationCounts:
    """Totals since start: draft tokens the target judged, those it kept, and the rows that had a
    draft in a verify step (each emitted its accepted tokens plus one)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafted_rows: int = 0
    guesses: int = 0  # drafts made behind a step in flight whose guess of its token was read
    guesses_held: int = 0  # of those, the ones whose guess was that token
    reads_first: int = 0  # steps that read the step in flight before drafting (poor guesses)
    draft_host_s: float = 0.0  # the host's time in `drafts` (drafters built, proposals), all steps
    ahead_host_s: float = 0.0  # the host's time in `build_ahead` (behind steps in flight)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafted row emitted per verify step (accepted + 1); 0.0 before any."""
        return 1.0 + self.accepted_tokens / self.drafted_rows if self.drafted_rows else 0.0


class Speculation:
    def __init__(self, config: SpeculativeConfig, *, measure_costs: bool = True) -> None:
        """`measure_costs=False` (tensor parallelism: each rank times its own steps, and every rank
        must pause the same rows): the back-off's break-even is `config.break_even`, else
        `DEFAULT_BREAK_EVEN`, never measured."""
        self.config = config
        self.store = SuffixStore() if config.method == "suffix" else None
        self.counts = SpeculationCounts()
        self.costs = StepCosts()
        self.measure_costs = measure_costs

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
        started = time.perf_counter()
        drafts: list[list[int]] = []
        counts = self.counts
        break_even = self.break_even(len(requests))
        for request in requests:
            unread = _unread(request)
            room = 0 if unread and not self.drafts_in_flight else self._draft_room(request, context_length)
            drafter = self._drafter(request) if room > 0 else None
            if drafter is None:
                drafts.append([])
                continue
            drafter.break_even = break_even
            if self.config.drafts_with_model:
                drafts.append([DRAFT_PENDING] * room)
            else:
                token_ids = request.all_ids
                held = drafter.read_guess(token_ids)
                if held is not None:
                    counts.guesses += 1
                    counts.guesses_held += held
                drafts.append(drafter.propose(token_ids, room, unread))
        counts.draft_host_s += time.perf_counter() - started
        return drafts

    def build_ahead(self, requests: Sequence[Request]) -> None:
        """Behind a step in flight that does not speculate because its batch of `requests` is over
        `max_batch_size` (by at most as much again): build the drafters of up to `AHEAD_PER_STEP`
        rows that have none and may draft (no grammar), for the steps once the batch is at the cap.
        Nothing with a draft model (its rows' drafters hold no proposer)."""
        cap = self.config.max_batch_size
        if self.config.drafts_with_model or not cap < len(requests) <= 2 * cap:
            return
        started = time.perf_counter()
        built = 0
        for request in requests:
            if request.drafter is None and request.grammar is None:
                self._drafter(request)
                built += 1
                if built == AHEAD_PER_STEP:
                    break
        self.counts.ahead_host_s += time.perf_counter() - started

    def break_even(self, rows: int) -> float:
        """The accepted tokens a verify step of `rows` rows must average to pay (the drafters'
        back-off): the config's, else measured (`StepCosts`), else `DEFAULT_BREAK_EVEN`."""
        if self.config.break_even is not None:
            return self.config.break_even
        return self.costs.break_even(rows) if self.measure_costs else DEFAULT_BREAK_EVEN

    def reads_first(self, requests: Sequence[Request], drafts: Sequence[Sequence[int]]) -> bool:
        """Whether a step whose `drafts` were made behind a step in flight should instead read that
        step first and draft again: half or more of the rows that drafted on a guess guess poorly
        of late (`RowDrafter.guesses_well`; a wrong guess loses the row's whole draft)."""
        guessing = poor = 0
        for request, draft in zip(requests, drafts):
            if draft and request.in_flight and request.drafter is not None:
                guessing += 1
                poor += not request.drafter.guesses_well
        if poor == 0 or 2 * poor < guessing:
            return False
        self.counts.reads_first += 1
        return True

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
        """`request` ended: its whole output joins the suffix store if it ended as the model meant
        it to (a stop or its length), also the tokens after its last proposal."""
        if request.drafter is not None and reason in ("stop", "length"):
            request.drafter.finish(request.all_ids)

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
            # from the prompt alone (a proposal catches up on the output): a suffix proposer's
            # output starts at the prompt's end, whichever step built it (`build_ahead` or not)
            request.drafter = RowDrafter(self.config, request.prompt_ids, self.store)
        return request.drafter


def _unread(request: Request) -> int:
    """Tokens of `request` a step in flight is computing: its next token (1), or none (0). A verify
    step, whose count varies, is always read before the next step is scheduled."""
    return 1 if request.in_flight else 0
