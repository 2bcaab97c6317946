"""Prompt lookup drafts what followed the most recent earlier occurrence of the longest suffix."""

from __future__ import annotations

import random
import time

import pytest

from snugkv.speculative.ngram import NgramConfig, NgramMatch, NgramProposer


def _rescan(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule read literally: a full scan of the tokens for every lookup."""
    end = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > end:
            continue
        for start in range(end - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[end - n :]:
                period = end - n - start
                return [tokens[start + n + j % period] for j in range(k)]
    return []


def test_a_repeated_phrase_drafts_what_followed_it():
    proposer = NgramProposer(NgramConfig(min_n=2, max_n=3), [1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert proposer.propose(2) == [4, 5]
    assert proposer.find() == NgramMatch(ngram_tokens=3, start=0, period=6)


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one():
    tokens = [1, 2, 3, 7, 5, 2, 3, 8, 9, 1, 2, 3]
    assert NgramProposer(NgramConfig(min_n=2, max_n=3), tokens).propose(1) == [7]
    assert NgramProposer(NgramConfig(min_n=2, max_n=2), tokens).propose(1) == [8]


def test_the_most_recent_earlier_occurrence_wins():
    assert NgramProposer(NgramConfig(min_n=2, max_n=2), [1, 2, 5, 1, 2, 6, 1, 2]).propose(1) == [6]


def test_no_match_and_a_too_short_context_draft_nothing():
    assert NgramProposer(NgramConfig(), [1, 2, 3, 4, 5, 6]).propose(4) == []
    assert NgramProposer(NgramConfig(min_n=2), [1]).propose(4) == []
    assert NgramProposer(NgramConfig()).propose(4) == []
    assert NgramProposer(NgramConfig(), [1, 2, 1, 2]).propose(0) == []


def test_a_match_overlapping_the_suffix_continues_the_period():
    assert NgramProposer(NgramConfig(min_n=1, max_n=3), [7, 7, 7, 7]).propose(3) == [7, 7, 7]
    assert NgramProposer(NgramConfig(min_n=2, max_n=2), [1, 2, 1, 2, 1, 2]).propose(5) == [1, 2, 1, 2, 1]
    # period 3, longer than the matched 2 tokens: a b c a b -> c a b c
    assert NgramProposer(NgramConfig(min_n=2, max_n=2), [4, 5, 6, 4, 5]).propose(4) == [6, 4, 5, 6]


def test_extending_token_by_token_matches_a_rescan_at_every_length():
    for seed, alphabet in ((0, 2), (1, 3), (2, 5), (3, 20)):
        rng = random.Random(seed)
        tokens = [rng.randrange(alphabet) for _ in range(300)]
        for min_n, max_n in ((1, 1), (2, 4), (3, 6)):
            proposer = NgramProposer(NgramConfig(min_n=min_n, max_n=max_n))
            for end in range(len(tokens)):
                assert proposer.propose(5) == _rescan(tokens[:end], 5, min_n, max_n), (seed, min_n, end)
                proposer.extend([tokens[end]])


def test_extending_in_chunks_is_extending_at_once():
    rng = random.Random(7)
    tokens = [rng.randrange(6) for _ in range(500)]
    chunked = NgramProposer()
    for start in range(0, len(tokens), 37):
        chunked.extend(tokens[start : start + 37])
    whole = NgramProposer(token_ids=tokens)
    assert chunked.num_tokens == whole.num_tokens == 500
    assert chunked.find() == whole.find() and chunked.propose(8) == whole.propose(8)
    # chunks of any size (none, shorter and longer than the n-grams) index exactly what one token
    # at a time does, and draft what a rescan finds after each
    for seed, (min_n, max_n) in enumerate(((1, 1), (2, 4), (3, 6))):
        rng = random.Random(seed)
        tokens = [rng.randrange(4) for _ in range(400)]
        one_by_one, in_chunks = (
            NgramProposer(NgramConfig(min_n, max_n)),
            NgramProposer(NgramConfig(min_n, max_n)),
        )
        end = 0
        while end < len(tokens):
            size = rng.choice((0, 1, 2, 3, 5, 8, 40))
            chunk = tokens[end : end + size]
            for token in chunk:
                one_by_one.extend([token])
            in_chunks.extend(chunk)
            end += len(chunk)
            assert in_chunks._latest_start == one_by_one._latest_start, (seed, end)
            assert in_chunks.propose(5) == _rescan(tokens[:end], 5, min_n, max_n), (seed, end)


def test_a_long_context_finds_a_far_match_without_rescanning():
    rng = random.Random(11)
    tokens = [rng.randrange(1000, 50_000) for _ in range(200_000)]
    tokens[5:12] = [1, 2, 3, 4, 5, 6, 7]  # planted near the start, looked up at the end
    proposer = NgramProposer(NgramConfig(min_n=2, max_n=4), tokens)
    proposer.extend([1, 2, 3])
    assert proposer.propose(4) == [4, 5, 6, 7]
    started = time.perf_counter()
    for step in range(2_000):  # a decode loop: one proposal and one accepted token per step
        proposer.propose(4)
        proposer.extend([rng.randrange(1000, 50_000) if step % 2 else 1])
    # each step is a few dict lookups (~10 us); a rescan of 200k tokens would take ~10 ms a step
    assert time.perf_counter() - started < 2.0


@pytest.mark.parametrize(("min_n", "max_n"), [(0, 2), (3, 2)])
def test_a_config_without_a_suffix_length_is_refused(min_n: int, max_n: int):
    with pytest.raises(ValueError, match="min_n"):
        NgramConfig(min_n=min_n, max_n=max_n)


def test_a_negative_draft_length_is_refused():
    with pytest.raises(ValueError, match="cannot be negative"):
        NgramProposer().propose(-1)
