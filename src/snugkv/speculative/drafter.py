"""One request's drafting: its proposer, kept in step with its tokens, and its acceptance back-off.

`RowDrafter` owns a request's `NgramProposer` or `SuffixProposer` (none with `--speculative draft`,
whose drafts come from model forwards on the device: snugkv.runner.draft_steps), the counts of what it proposed
and what the target accepted, and the back-off for a row whose drafts keep being rejected. It never
decides whether a batch speculates (the scheduler's speculation does, from the batch size), never
touches the device and never verifies.

Back-off, from what a verify step costs here: a verify step emits a row's accepted draft tokens
plus one in a verify step's time and the host's work after it (a verify step is read before the
next step is scheduled), a plain step one token in a decode step's time (its host work hides behind
the device). So a row's drafts pay while its verify steps average more accepted tokens than the
break-even `(verify + host - decode) / decode`, which the scheduler's speculation measures on this
engine for the batch's size (`StepCosts`; ~0.3 for an 8B model in bf16 on an H100, ~1.3 for a
135M one, whose steps are too short to hide much) and sets as `break_even` before each proposal.
After each verify step that judged a draft, the row's recent accepted tokens are `DECAY * recent +
(1 - DECAY) * accepted` (`num_tokens` at the start: drafts are tried); below the break-even the row
drafts nothing until it has `pause_tokens` more tokens (counted in tokens, so a pause ends whether
or not the steps between speculated), then tries again from the break-even itself (one more poor
step pauses it again), so a text that turns repetitive later still gets drafts.
A proposer that finds nothing costs a lookup (a row drafts behind a step in flight, so a step
without drafts is an ordinary overlapped decode step): the row proposes again at its next step.
Where a verify step costs more than a decode step's token (break-even 1 or more), a draft found
right after nothing was found is rarely worth its step: such a row pauses 2, 4, 8, ... tokens after
the 1st, 2nd, 3rd, ... empty proposal in a row (at most `pause_tokens`; a draft found starts the
count again). Replayed over SmolLM2's text (`policy_steps` in snugkv.bench.speculative_replay, which
runs this class as the scheduler does at batch 1): with the 8B's step costs, code edits at k = 8
went from 1.46x to 2.05x against the pauses before (16 tokens below 20% acceptance, and after every
empty proposal), open text stayed at 1.16-1.19x; with SmolLM2's own costs no workload lost.
"""

from __future__ import annotations

from collections.abc import Sequence

from snugkv.speculative.config import DEFAULT_BREAK_EVEN, SpeculativeConfig
from snugkv.speculative.ngram import NgramProposer
from snugkv.speculative.suffix import SuffixProposer, SuffixStore

DECAY = 0.5  # weight of the earlier steps in a row's recent accepted tokens
# A row whose recent guesses of the token in flight held less often than this has its next draft
# made after that token is read (`RowDrafter.guesses_well`). A wrong guess costs a verify step that
# emits one token (verify + the host's gap after it, against an overlapped decode step); reading
# first costs the host's gap once: with an 8B's bf16 steps on an H100 (decode 5.8 ms, verify 6.7,
# host ~0.7) the guess pays above 1 - 0.7 / (6.7 + 0.7 - 5.8) = 0.56.
MIN_GUESS_RATE = 0.6


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
        self.recent_accepted = float(config.num_tokens)  # accepted tokens a verify step, DECAY-weighted
        self.break_even = DEFAULT_BREAK_EVEN  # set by the scheduler's speculation from measured costs
        self.resume_at_tokens = 0  # paused: no draft before the request has this many tokens
        self.empty_proposals = 0  # proposals in a row that found nothing
        self.guesses = 0  # drafts made behind a step in flight whose guess was then read
        self.guesses_held = 0  # of those, the ones whose guess was the token the step computed
        self.recent_guess_rate = 1.0  # DECAY-weighted, as `recent_accepted`
        self._guess: tuple[int, int] | None = None  # (position, token) not read yet

    @property
    def guesses_well(self) -> bool:
        """Whether this row's recent guesses of a token in flight held often enough to draft behind
        it (`MIN_GUESS_RATE`); a row that does not has the step read first."""
        return self.recent_guess_rate >= MIN_GUESS_RATE

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
        self.read_guess(token_ids)
        _catch_up(proposer, token_ids)
        num_tokens = len(token_ids) + unread
        if k <= 0 or not self.may_draft(num_tokens):
            return []
        if isinstance(proposer, SuffixProposer):
            proposal = list(proposer.propose(k + unread).token_ids)
        else:
            proposal = proposer.propose(k + unread)
        draft = proposal[unread:]
        if draft and unread:
            self._guess = (len(token_ids), proposal[0])
        if draft:
            self.empty_proposals = 0
        elif self.break_even >= 1.0:  # pause 2, 4, 8, ... tokens, at most pause_tokens
            self.empty_proposals += 1
            pause = min(2 ** min(self.empty_proposals, 30), self.config.pause_tokens)
            self.resume_at_tokens = num_tokens + pause
        return draft

    def read_guess(self, token_ids: Sequence[int]) -> bool | None:
        """Once `token_ids` (the request's tokens) holds the token a pending guess was of: count
        the guess and return whether it held; None while there is none to read (`propose` reads
        it first too)."""
        guess = self._guess
        if guess is None or len(token_ids) <= guess[0]:
            return None
        self._guess = None
        held = token_ids[guess[0]] == guess[1]
        self.guesses += 1
        self.guesses_held += held
        self.recent_guess_rate = DECAY * self.recent_guess_rate + (1 - DECAY) * held
        return held

    def record(self, proposed: int, accepted: int, num_tokens: int) -> None:
        """A verify step judged `proposed` draft tokens of this row and kept `accepted`; the request
        holds `num_tokens` tokens after it."""
        if proposed <= 0:
            return
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        self.drafted_steps += 1
        self.recent_accepted = DECAY * self.recent_accepted + (1 - DECAY) * accepted
        if self.recent_accepted < self.break_even:
            self.resume_at_tokens = num_tokens + self.config.pause_tokens
            self.recent_accepted = self.break_even

    def finish(self, token_ids: Sequence[int]) -> None:
        """The request ended holding `token_ids` (all its tokens): a suffix proposer takes those it
        has not seen and hands its whole output to the shared store, whenever the drafter was built
        and however long ago it last proposed."""
        if isinstance(self.proposer, SuffixProposer):
            _catch_up(self.proposer, token_ids)
            self.proposer.finish()


def _catch_up(proposer: NgramProposer | SuffixProposer, token_ids: Sequence[int]) -> None:
    """Feed `proposer` the tokens of `token_ids` (a request's tokens so far) it has not seen."""
    if len(token_ids) > proposer.num_tokens:
        proposer.extend(token_ids[proposer.num_tokens :])
