"""Suffix decoding drafts the most frequent continuation of the longest matched suffix, as long as
the match and its frequency support, from the request's tokens and a bounded store of outputs."""

from __future__ import annotations

import random
import time

import pytest

from snugkv.speculative.suffix import SuffixConfig, SuffixDraft, SuffixProposer, SuffixStore


def _rescan(context: list[int], outputs: list[list[int]], k: int, config: SuffixConfig) -> SuffixDraft:
    """The module's rule read literally: every occurrence found by a scan, no index, no cap."""
    gram = config.min_match_tokens
    if k == 0 or len(context) < gram:
        return SuffixDraft()
    last = context[len(context) - gram :]
    own = [(context, s) for s in range(len(context) - gram - 1, -1, -1) if context[s : s + gram] == last]
    stored = [
        (tokens, s)
        for tokens in reversed(outputs)
        for s in range(len(tokens) - gram - 1, -1, -1)
        if tokens[s : s + gram] == last
    ]
    occurrences = own + stored
    if not occurrences:
        return SuffixDraft()
    suffix_start = len(context) - gram

    def agreement(tokens: list[int], start: int) -> int:
        agreed = 0
        for back in range(1, config.max_match_tokens - gram + 1):
            if (
                start - back < 0
                or suffix_start - back < 0
                or tokens[start - back] != context[suffix_start - back]
            ):
                break
            agreed += 1
        return agreed

    agreements = [agreement(tokens, start) for tokens, start in occurrences]
    longest = max(agreements)
    following = [(t, s + gram) for (t, s), a in zip(occurrences, agreements) if a == longest]
    draft: list[int] = []
    probabilities: list[float] = []
    probability = 1.0
    while len(draft) < min(k, int(config.draft_tokens_per_match_token * (gram + longest))):
        nexts = [t[i] for t, i in following if i < len(t)]
        if not nexts:
            break
        token = max(dict.fromkeys(nexts), key=nexts.count)
        probability *= nexts.count(token) / len(nexts)
        if probability < config.min_probability:
            break
        draft.append(token)
        probabilities.append(probability)
        following = [(t, i + 1) for t, i in following if i < len(t) and t[i] == token]
    return SuffixDraft(tuple(draft), gram + longest, tuple(probabilities))


def test_a_repeated_phrase_drafts_its_continuation_as_long_as_the_match():
    proposer = SuffixProposer([1, 2, 3, 4, 5, 6, 9, 1, 2, 3], SuffixConfig(min_match_tokens=2))
    draft = proposer.propose(8)
    assert draft == SuffixDraft((4, 5, 6), match_tokens=3, probabilities=(1.0, 1.0, 1.0))
    assert draft.score == 3.0


def test_a_longer_match_earns_a_longer_draft():
    phrase = list(range(100, 110))
    short = SuffixProposer([*phrase, 7, *phrase[:2]], SuffixConfig(min_match_tokens=2))
    long = SuffixProposer([*phrase, 7, *phrase[:6]], SuffixConfig(min_match_tokens=2))
    assert short.propose(8).token_ids == (102, 103)  # a bare 2-token match: 2 tokens
    assert long.propose(8).token_ids == (106, 107, 108, 109, 7, 100)  # 6 matched: 6 tokens
    halved = SuffixProposer([*phrase, 7, *phrase[:6]], SuffixConfig(draft_tokens_per_match_token=0.5))
    assert halved.propose(8).token_ids == (106, 107, 108)


def test_the_most_frequent_continuation_wins_and_its_share_is_its_probability():
    config = SuffixConfig(min_match_tokens=2, draft_tokens_per_match_token=4.0)
    store = SuffixStore(config)
    for output in ([5, 6, 7, 1], [5, 6, 8, 2], [5, 6, 7, 1], [5, 6, 7, 3]):
        store.add(output)
    draft = SuffixProposer([9, 5, 6], config, store).propose(4)
    # 7 follows 3 of 4; then 1 follows 2 of those 3: 3/4 * 2/3
    assert draft == SuffixDraft((7, 1), match_tokens=2, probabilities=(0.75, 0.5))


def test_the_longest_match_beats_a_more_frequent_shorter_one():
    config = SuffixConfig(min_match_tokens=2)
    store = SuffixStore(config)
    for output in ([4, 5, 6, 8], [2, 5, 6, 7], [2, 5, 6, 7], [2, 5, 6, 7]):
        store.add(output)
    assert SuffixProposer([4, 5, 6], config, store).propose(4) == SuffixDraft((8,), 3, (1.0,))


def test_a_split_continuation_drafts_nothing_below_the_probability_floor():
    outputs = ([5, 6, 1], [5, 6, 2], [5, 6, 3], [5, 6, 4])
    weak = SuffixConfig(min_probability=0.3)
    store = SuffixStore(weak)
    for output in outputs:
        store.add(output)
    assert SuffixProposer([5, 6], weak, store).propose(4).token_ids == ()
    lenient = SuffixConfig(min_probability=0.2)
    store = SuffixStore(lenient)
    for output in outputs:
        store.add(output)
    assert SuffixProposer([5, 6], lenient, store).propose(4) == SuffixDraft(
        (4,), 2, (0.25,)
    )  # newest wins a tie


def test_the_requests_own_continuation_wins_a_tie_with_the_store():
    store = SuffixStore()
    store.add([5, 6, 8, 8])
    assert SuffixProposer([5, 6, 7, 0, 5, 6], store=store).propose(1).token_ids == (7,)


def test_no_match_drafts_nothing():
    store = SuffixStore()
    store.add([1, 2, 3, 4])
    assert SuffixProposer([9, 8, 7, 6], store=store).propose(4) == SuffixDraft()
    assert SuffixProposer([9]).propose(4) == SuffixDraft()
    assert SuffixProposer([1, 2, 1, 2]).propose(0) == SuffixDraft()


def test_finish_gives_the_store_the_output_once_and_not_the_prompt():
    store = SuffixStore()
    proposer = SuffixProposer([1, 2, 3], store=store)
    proposer.extend([4, 5, 6])
    proposer.finish()
    proposer.finish()
    assert store.num_sequences == 1 and store.num_tokens == 3
    assert store.occurrences((4, 5), limit=8) and not store.occurrences((1, 2), limit=8)


def test_the_store_keeps_its_bound_and_forgets_the_oldest_outputs_first():
    store = SuffixStore(SuffixConfig(store_max_tokens=100))
    rng = random.Random(5)
    outputs = [
        [1000 + index, *(rng.randrange(4) for _ in range(rng.randrange(3, 30)))] for index in range(60)
    ]
    for output in outputs:
        store.add(output)
        store.check_integrity()
        assert store.num_tokens <= 100
    kept = [output for output in outputs if (output, 0) in store.occurrences(tuple(output[:2]), limit=1)]
    assert kept == outputs[-store.num_sequences :]  # the newest, and as many as fit
    assert sum(map(len, kept)) + len(outputs[-len(kept) - 1]) > 100
    store.add(list(range(500)))  # alone larger than the bound: its last 100 tokens stay
    store.check_integrity()
    assert store.num_sequences == 1 and store.num_tokens == 100
    assert store.occurrences((400, 401), 1) == [(list(range(400, 500)), 0)]
    assert store.occurrences((398, 399), 1) == []


def test_a_store_of_no_tokens_stores_nothing():
    store = SuffixStore(SuffixConfig(store_max_tokens=0))
    store.add([1, 2, 3, 4])
    store.check_integrity()
    assert store.num_tokens == 0


def test_drafts_match_a_rescan_through_growth_and_eviction():
    for seed in range(6):
        rng = random.Random(seed)
        config = SuffixConfig(
            min_match_tokens=rng.choice((1, 2, 3)),
            max_match_tokens=rng.choice((3, 6, 32)),
            max_candidates=10_000,  # the rescan has no cap
            draft_tokens_per_match_token=rng.choice((0.5, 1.0, 3.0)),
            min_probability=rng.choice((0.0, 0.2, 0.5)),
            store_max_tokens=rng.choice((0, 50, 400)),
        )
        alphabet = rng.choice((2, 4, 8))
        store = SuffixStore(config)
        kept: list[list[int]] = []
        for _ in range(12):
            prompt = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 20))]
            proposer = SuffixProposer(prompt, config, store)
            context = list(prompt)
            for _ in range(rng.randrange(1, 40)):
                k = rng.randrange(0, 6)
                assert proposer.propose(k) == _rescan(context, kept, k, config), (seed, context)
                token = rng.randrange(alphabet)
                proposer.extend([token])
                context.append(token)
            proposer.finish()
            output = context[len(prompt) :]
            output = output[max(len(output) - config.store_max_tokens, 0) :]
            if len(output) > config.min_match_tokens:
                kept.append(output)
            while sum(map(len, kept)) > config.store_max_tokens:
                kept.pop(0)
            store.check_integrity()
            assert store.num_tokens == sum(map(len, kept))


def test_a_long_context_proposes_in_bounded_time():
    rng = random.Random(3)
    tokens = [rng.randrange(50) for _ in range(200_000)]  # every gram occurs ~80 times
    proposer = SuffixProposer(tokens, SuffixConfig(max_candidates=64))
    started = time.perf_counter()
    for _ in range(500):
        proposer.propose(8)
        proposer.extend([rng.randrange(50)])
    # ~150 us a step with 64 candidates; examining every occurrence would be ~80 ms a step
    assert time.perf_counter() - started < 5.0


def test_a_store_and_a_proposer_must_index_the_same_grams():
    with pytest.raises(ValueError, match="same SuffixConfig"):
        SuffixProposer([1], SuffixConfig(min_match_tokens=3), SuffixStore(SuffixConfig(min_match_tokens=2)))


@pytest.mark.parametrize(
    "fields",
    [
        {"min_match_tokens": 0},
        {"min_match_tokens": 4, "max_match_tokens": 3},
        {"max_candidates": 0},
        {"draft_tokens_per_match_token": 0.0},
        {"min_probability": 1.5},
        {"store_max_tokens": -1},
    ],
)
def test_a_config_out_of_range_is_refused(fields: dict[str, float]):
    with pytest.raises(ValueError, match="must be"):
        SuffixConfig(**fields)  # type: ignore[arg-type]
