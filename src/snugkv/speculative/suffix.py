"""Suffix decoding: draft what most often followed a request's longest matched suffix, in its own
tokens and in the recent outputs of other requests, as far as the evidence carries.

Owns `SuffixStore` (finished requests' outputs, bounded in tokens, oldest out first) and
`SuffixProposer` (one request's tokens, plus a store to read). It never touches the device or a
model, never keeps more than `store_max_tokens` tokens in a store, and never decides whether a
row speculates at all: it only says how long a draft the evidence supports (the scheduler's
back-off weighs that against the verify step's cost).

The method is SuffixDecoding's (Oliaro et al., arXiv:2411.04975): one structure over the request's
prompt and output, one over finished requests' outputs, continuations chosen by frequency, and a
draft length that grows with the match length. The structure here is not a suffix tree but the
part of one that a proposal walks, rebuilt per proposal from a gram index:

1. Index: each `min_match_tokens`-gram (the gram) maps to its occurrences that have a following
   token: the request's own tokens in one index, the store's outputs in another.
2. Match: the occurrences of the request's last gram (the most recent `max_candidates` of each
   index) are extended backwards while they agree with the request's tokens, up to
   `max_match_tokens`. The longest agreement is the match length `m`; the occurrences that reach it
   are the candidates (in a suffix tree: the node of the longest matched suffix).
3. Draft: their continuations are walked a token at a time. The next token is the one most
   candidates continue with (ties: the request's own occurrences, most recent first, then the
   store's); candidates that continue otherwise drop out, and those whose tokens ran out are not
   counted. A token's probability is the draft's so far times its share of the counted candidates.
4. Length, the adaptive part: the draft stops at the caller's `k`, at
   `floor(draft_tokens_per_match_token * m)` tokens (a long match earns a long draft, a bare gram a
   short one), and before a token whose probability would fall below `min_probability` (a rare or
   split continuation drafts few tokens or none).

A draft's `score` is the sum of its tokens' probabilities: the tokens the target would accept on
average if the candidates' frequencies were the target's probabilities.

Costs: indexing is one dict write per token, and an eviction one cut per distinct gram of the
evicted output; a proposal compares at most `2 * max_candidates` occurrences
over up to `max_match_tokens` tokens, then walks `k` steps over the candidates (20 us with few
occurrences, 160 us with 64 of each index, in CPython 3.11). Memory, with every gram distinct: a
store about 290 bytes a token (76 MB at the default bound of 262,144 tokens), a request about 260.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

_OFFSET_BITS = 32  # a store occurrence is one int: sequence id above these bits, start below
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1


@dataclass(frozen=True, slots=True)
class SuffixConfig:
    """The match, the draft length policy, and the store's bound (module docstring, steps 1-4)."""

    min_match_tokens: int = 2
    max_match_tokens: int = 32
    max_candidates: int = 64
    draft_tokens_per_match_token: float = 1.0
    min_probability: float = 0.1
    store_max_tokens: int = 1 << 18

    def __post_init__(self) -> None:
        if self.min_match_tokens < 1:
            raise ValueError(f"min_match_tokens must be at least 1, got {self.min_match_tokens}")
        if self.max_match_tokens < self.min_match_tokens:
            raise ValueError(
                f"max_match_tokens ({self.max_match_tokens}) must be at least min_match_tokens "
                f"({self.min_match_tokens})"
            )
        if self.max_candidates < 1:
            raise ValueError(f"max_candidates must be at least 1, got {self.max_candidates}")
        if self.draft_tokens_per_match_token <= 0:
            raise ValueError(
                f"draft_tokens_per_match_token must be positive, got {self.draft_tokens_per_match_token}"
            )
        if not 0.0 <= self.min_probability <= 1.0:
            raise ValueError(f"min_probability must be between 0 and 1, got {self.min_probability}")
        if not 0 <= self.store_max_tokens <= _OFFSET_MASK:
            raise ValueError(
                f"store_max_tokens must be between 0 and {_OFFSET_MASK}, got {self.store_max_tokens}"
            )


@dataclass(frozen=True, slots=True)
class SuffixDraft:
    """A proposal: its tokens, the match length that earned it (0: no match), and each token's
    probability (the draft up to and including it, under the candidates' frequencies)."""

    token_ids: tuple[int, ...] = ()
    match_tokens: int = 0
    probabilities: tuple[float, ...] = ()

    @property
    def score(self) -> float:
        """Expected accepted tokens, were the candidates' frequencies the target's probabilities."""
        return sum(self.probabilities)


Occurrence = tuple[Sequence[int], int]  # the tokens it lies in, and the start of the gram there


class SuffixStore:
    """Outputs of finished requests, shared by every request's proposer; the oldest output leaves
    first once the store holds more than `store_max_tokens` tokens. Not thread-safe: one
    scheduler thread adds and reads."""

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self._sequences: dict[int, list[int]] = {}  # insertion order is age
        self._next_id = 0
        self._num_tokens = 0
        # gram -> its occurrences, oldest first, each `sequence id << _OFFSET_BITS | start`
        self._occurrences: dict[tuple[int, ...], list[int]] = {}

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    def add(self, token_ids: Sequence[int]) -> None:
        """Store an output (only its last `store_max_tokens` tokens if it alone is larger)."""
        limit = self.config.store_max_tokens
        tokens = list(token_ids[len(token_ids) - limit :]) if len(token_ids) > limit else list(token_ids)
        if len(tokens) <= self.config.min_match_tokens:  # no gram with a follower: nothing to match
            return
        sequence_id = self._next_id
        self._next_id += 1
        self._sequences[sequence_id] = tokens
        self._num_tokens += len(tokens)
        for start, gram in enumerate(self._grams(tokens)):
            self._occurrences.setdefault(gram, []).append(sequence_id << _OFFSET_BITS | start)
        while self._num_tokens > limit:
            self._evict_oldest()

    def occurrences(self, gram: tuple[int, ...], limit: int) -> list[Occurrence]:
        """The `limit` most recent occurrences of `gram` that have a following token, newest first."""
        found = self._occurrences.get(gram)
        if not found:
            return []
        return [
            (self._sequences[packed >> _OFFSET_BITS], packed & _OFFSET_MASK)
            for packed in islice(reversed(found), limit)
        ]

    def check_integrity(self) -> None:
        """Raise if the index and the stored tokens disagree (a test's check after any history)."""
        expected = sum(
            max(len(tokens) - self.config.min_match_tokens, 0) for tokens in self._sequences.values()
        )
        indexed = sum(len(found) for found in self._occurrences.values())
        stored = sum(len(tokens) for tokens in self._sequences.values())
        if indexed != expected or stored != self._num_tokens or stored > self.config.store_max_tokens:
            raise RuntimeError(
                f"suffix store out of step: {indexed} occurrences indexed for {expected} grams, "
                f"{stored} tokens stored for {self._num_tokens} counted (bound {self.config.store_max_tokens})"
            )

    def _grams(self, tokens: list[int]) -> Iterable[tuple[int, ...]]:
        """Each gram that has a following token, in order of its start."""
        gram = self.config.min_match_tokens
        return (tuple(tokens[start : start + gram]) for start in range(len(tokens) - gram))

    def _evict_oldest(self) -> None:
        sequence_id = next(iter(self._sequences))
        tokens = self._sequences.pop(sequence_id)
        self._num_tokens -= len(tokens)
        # Occurrences were appended oldest output first, so this output's lead every list it is in:
        # one cut per gram (a list, not a deque, as most grams occur once: 64 bytes, not 600).
        for gram, count in Counter(self._grams(tokens)).items():
            found = self._occurrences[gram]
            del found[:count]
            if not found:
                del self._occurrences[gram]


class SuffixProposer:
    """One request's suffix index (prompt, then accepted output tokens) and its drafts, reading a
    shared `SuffixStore` if given; `finish` hands the request's output to that store."""

    def __init__(
        self, prompt_ids: Sequence[int], config: SuffixConfig | None = None, store: SuffixStore | None = None
    ) -> None:
        self.config = config or SuffixConfig()
        if store is not None and store.config.min_match_tokens != self.config.min_match_tokens:
            raise ValueError(
                f"the store indexes {store.config.min_match_tokens}-token grams and this proposer "
                f"{self.config.min_match_tokens}-token ones; give both the same SuffixConfig"
            )
        self.store = store
        self._tokens: list[int] = []
        self._starts: dict[tuple[int, ...], list[int]] = {}  # gram -> starts with a follower, ascending
        self._prompt_len = len(prompt_ids)
        self._finished = False
        self.extend(prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append accepted tokens to the request's index."""
        tokens, gram = self._tokens, self.config.min_match_tokens
        for token in token_ids:
            start = len(tokens) - gram  # the gram ending at the last token now has a follower
            if start >= 0:
                self._starts.setdefault(tuple(tokens[start:]), []).append(start)
            tokens.append(token)

    def finish(self) -> None:
        """Give the request's output to the store (once; later calls do nothing)."""
        if self.store is not None and not self._finished:
            self.store.add(self._tokens[self._prompt_len :])
        self._finished = True

    def propose(self, k: int) -> SuffixDraft:
        """A draft of at most `k` tokens to follow the request's tokens (empty where no evidence)."""
        if k < 0:
            raise ValueError(f"k is the number of draft tokens wanted and cannot be negative, got {k}")
        config, tokens = self.config, self._tokens
        gram = config.min_match_tokens
        if k == 0 or len(tokens) < gram:
            return SuffixDraft()
        match_tokens, candidates = self._match(tuple(tokens[len(tokens) - gram :]))
        if not candidates:
            return SuffixDraft()
        limit = min(k, int(config.draft_tokens_per_match_token * match_tokens))
        draft: list[int] = []
        probabilities: list[float] = []
        probability = 1.0
        following = [(sequence, start + gram) for sequence, start in candidates]
        while len(draft) < limit:
            counts: dict[int, int] = {}  # insertion order = candidate order, which breaks ties
            for sequence, index in following:
                if index < len(sequence):
                    counts[sequence[index]] = counts.get(sequence[index], 0) + 1
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)
            probability *= counts[token] / sum(counts.values())
            if probability < config.min_probability:
                break
            draft.append(token)
            probabilities.append(probability)
            following = [
                (sequence, index + 1)
                for sequence, index in following
                if index < len(sequence) and sequence[index] == token
            ]
        return SuffixDraft(tuple(draft), match_tokens, tuple(probabilities))

    def _match(self, last_gram: tuple[int, ...]) -> tuple[int, list[Occurrence]]:
        """The longest match length and the occurrences that reach it, the request's first."""
        config, tokens = self.config, self._tokens
        own = [
            (tokens, start)
            for start in islice(reversed(self._starts.get(last_gram, ())), config.max_candidates)
        ]
        stored = self.store.occurrences(last_gram, config.max_candidates) if self.store is not None else []
        occurrences = own + stored
        if not occurrences:
            return 0, []
        suffix_start = len(tokens) - config.min_match_tokens
        most = config.max_match_tokens - config.min_match_tokens  # agreement counted beyond the gram
        agreements = []
        for sequence, start in occurrences:
            agreed = 0
            while (
                agreed < most
                and agreed < start
                and agreed < suffix_start
                and sequence[start - 1 - agreed] == tokens[suffix_start - 1 - agreed]
            ):
                agreed += 1
            agreements.append(agreed)
        longest = max(agreements)
        candidates = [occurrence for occurrence, agreed in zip(occurrences, agreements) if agreed == longest]
        return config.min_match_tokens + longest, candidates
