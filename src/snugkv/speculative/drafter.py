"""One request's drafting: its proposer, kept in step with its tokens, and its acceptance back-off.

`RowDrafter` owns a request's `NgramProposer` or `SuffixProposer` (none with `--speculative draft`,
whose drafts come from model forwards on the device: snugkv.runner.draft_steps), the counts of what it proposed
and what the target accepted, and the back-off for a row whose drafts keep being rejected. It never
decides whether a batch speculates (the scheduler's speculation does, from the batch size), never
touches the device and never verifies.

Back-off: after each verify step that judged a draft, the row's recent acceptance is
`DECAY * recent + (1 - DECAY) * accepted / proposed` (1.0 at the start). Below the config's
`min_acceptance` the row drafts nothing until it has `pause_tokens` more tokens (counted in tokens,
so a pause ends whether or not the steps between speculated), then tries again from the threshold
itself (one more poor step pauses it again), so a text that turns repetitive later still gets drafts.
A row whose proposer found nothing pauses too, for 2, 4, 8, ... tokens after the 1st, 2nd, 3rd, ...
empty proposal in a row (at most `pause_tokens`; a draft found starts the count again): a step that
may speculate was not overlapped until drafts were made behind a step in flight, which open text
that never matches paid at every step; the pauses also save the proposer's lookups. (Until
2026-12-06 a row paused only after 4 empty proposals in a row, for `pause_tokens`: a fifth of open
text's steps ran unoverlapped, and open text at batch 1 ran at 0.84x on an H100, SmolLM2.)
"""

from __future__ import annotations

from collections.abc import Sequence

from snugkv.speculative.config import SpeculativeConfig
from snugkv.speculative.ngram import NgramProposer
from snugkv.speculative.suffix import SuffixProposer, SuffixStore

DECAY = 0.5  # weight of the earlier steps in a row's recent acceptance


class RowDrafter:
    def __init__(
        self, config: SpeculativeConfig, token_ids: Sequence[int], store: SuffixStore | None
    ) -> None:
        self.config = config
        self.proposer: NgramProposer | SuffixProposer | None = None  # None: a draft model proposes
        if config.method == "suffix":
            self.proposer = SuffixProposer(token_ids, store.config if store else None, store)
        elif config.method == "ngram":
            self.proposer = NgramProposer(token_ids=token_ids)
        self.proposed_tokens = 0  # draft tokens the target judged
        self.accepted_tokens = 0  # of those, the ones it kept
        self.drafted_steps = 0  # verify steps in which this row had a draft
        self.recent_acceptance = 1.0
        self.resume_at_tokens = 0  # paused: no draft before the request has this many tokens
        self.empty_proposals = 0  # proposals in a row that found nothing

    def may_draft(self, num_tokens: int) -> bool:
        """Whether the row drafts at all once the request holds `num_tokens` tokens (not paused)."""
        return num_tokens >= self.resume_at_tokens

    def propose(self, token_ids: Sequence[int], k: int, unread: int = 0) -> list[int]:
        """Up to `k` draft tokens to follow `token_ids` (the request's tokens so far, a superset of
        what the proposer saw: the tokens it has not seen are fed first); none while paused.
        `unread`: tokens after `token_ids` that a step in flight is computing (0 or 1): the proposer
        continues `token_ids` by `unread + k` and the first `unread`, its guesses of those tokens,
        are dropped (a draft whose guess was wrong is judged after the real token, and rejected)."""
        proposer = self.proposer
        if proposer is None:
            raise RuntimeError("this row's drafts come from a draft model, not a host proposer")
        if len(token_ids) > proposer.num_tokens:
            proposer.extend(token_ids[proposer.num_tokens :])
        num_tokens = len(token_ids) + unread
        if k <= 0 or not self.may_draft(num_tokens):
            return []
        if isinstance(proposer, SuffixProposer):
            draft = list(proposer.propose(k + unread).token_ids)[unread:]
        else:
            draft = proposer.propose(k + unread)[unread:]
        if draft:
            self.empty_proposals = 0
        else:  # pause 2, 4, 8, ... tokens, at most pause_tokens
            self.empty_proposals += 1
            pause = min(2 ** min(self.empty_proposals, 30), self.config.pause_tokens)
            self.resume_at_tokens = num_tokens + pause
        return draft

    def record(self, proposed: int, accepted: int, num_tokens: int) -> None:
        """A verify step judged `proposed` draft tokens of this row and kept `accepted`; the request
        holds `num_tokens` tokens after it."""
        if proposed <= 0:
            return
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        self.drafted_steps += 1
        self.recent_acceptance = DECAY * self.recent_acceptance + (1 - DECAY) * accepted / proposed
        if self.recent_acceptance < self.config.min_acceptance:
            self.resume_at_tokens = num_tokens + self.config.pause_tokens
            self.recent_acceptance = self.config.min_acceptance

    def finish(self) -> None:
        """The request ended: a suffix proposer hands its output to the shared store."""
        if isinstance(self.proposer, SuffixProposer):
            self.proposer.finish()
