"""Prompt scoring rows: logits only for the rows that score their prompt (every new token) and the
last token of the rows that sample; the split hands the sampler one row per sampled request and
scores each prompt token from the logits of the position before it."""

from __future__ import annotations

import torch

from snugkv.core.forward import BatchRow
from snugkv.core.sampling import SamplingParams
from snugkv.scheduler.prompt_scores import split_logits
from snugkv.scheduler.request import Request
from tests.runner.test_forward_batch import _build

VOCAB = 12


def test_only_scoring_rows_get_logits_beyond_their_last_token():
    rows = [
        BatchRow(1, 0, [5, 6, 7], prompt_logits=True),
        BatchRow(2, 0, [8, 9]),
        BatchRow(3, 4, [1, 2, 3], need_logits=False, prompt_logits=True),
        BatchRow(4, 0, [4, 4], need_logits=False),
    ]
    assert _build(rows).logits_indices.tolist() == [0, 1, 2, 4, 5, 6, 7]


def test_split_samples_the_last_row_and_scores_each_token_from_the_position_before():
    scoring = Request("a", [5, 6, 7, 8], SamplingParams(prompt_logprobs=1, max_new_tokens=0))
    scoring.prompt_logprobs.append(None)
    plain = Request("b", [3, 4], SamplingParams())
    rows = [BatchRow(1, 0, [5, 6, 7, 8], prompt_logits=True), BatchRow(2, 0, [3, 4])]
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    sample_logits, scores = split_logits(logits, rows, [scoring, plain])
    assert torch.equal(sample_logits, logits[[3, 4]])
    assert scores is not None
    scores.add_to_requests(str)
    log_softmax = torch.log_softmax(logits, -1)
    entries = scoring.prompt_logprobs
    assert entries[0] is None and [e.token_id for e in entries[1:]] == [6, 7, 8]
    for position, entry in enumerate(entries[1:], start=1):
        assert entry.logprob == float(log_softmax[position - 1, scoring.prompt_ids[position]])
        assert entry.top_ids == (int(log_softmax[position - 1].argmax()),)
    assert not scoring.scores_prompt


def test_a_chunked_prompt_is_scored_across_chunks_without_gaps_or_repeats():
    request = Request("a", list(range(1, 8)), SamplingParams(prompt_logprobs=0))
    request.prompt_logprobs.append(None)
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(1))
    for start, end in ((0, 3), (3, 7)):
        row = BatchRow(1, start, request.prompt_ids[start:end], need_logits=end == 7, prompt_logits=True)
        _, scores = split_logits(logits[start:end], [row], [request])
        assert scores is not None
        scores.add_to_requests(str)
    assert [e.token_id for e in request.prompt_logprobs[1:]] == list(range(2, 8))
    log_softmax = torch.log_softmax(logits, -1)
    assert [e.logprob for e in request.prompt_logprobs[1:]] == [
        float(log_softmax[p - 1, request.prompt_ids[p]]) for p in range(1, 7)
    ]
