"""Logit processors (logit_bias, repetition/frequency/presence penalties, min_tokens, min_p) against
plain per-token reference implementations, the token history they read, and a batch that uses none
of them paying for none."""

from __future__ import annotations

import math

import pytest
import torch

from snugkv.core.sampling import InvalidRequest, SamplingParams
from snugkv.layers.sampler import Sampler, _min_p_filter
from snugkv.runner.token_history import TokenHistory

VOCAB = 40
EOS = 2


def reference_process(
    logits: list[float], p: SamplingParams, prompt: list[int], outputs: list[int], eos: int
) -> list[float]:
    """OpenAI's and vLLM's rules written out token by token."""
    out = list(logits)
    for token, bias in p.logit_bias:
        out[token] += bias
    for token in set(prompt) | set(outputs):
        if out[token] > 0:
            out[token] /= p.repetition_penalty
        else:
            out[token] *= p.repetition_penalty
    for token in set(outputs):
        out[token] -= p.frequency_penalty * outputs.count(token) + p.presence_penalty
    if len(outputs) < p.min_tokens:
        for token in {*p.stop_token_ids, *(() if p.ignore_eos else (eos,))}:
            out[token] = -math.inf
    return out


CASES = [
    (SamplingParams(), [3, 4], [5]),
    (SamplingParams(repetition_penalty=1.7), [3, 4, 9, 9], [5, 6, 6]),
    (SamplingParams(frequency_penalty=0.8, presence_penalty=-0.5), [3], [5, 6, 6, 6, 7]),
    (SamplingParams(logit_bias=((1, 5.0), (7, -100.0), (1, 2.0))), [8], []),
    (SamplingParams(min_tokens=4, stop_token_ids=(11,)), [3], [5, 6]),
    (SamplingParams(min_tokens=2, stop_token_ids=(11,), ignore_eos=True), [3], [5, 6]),
    (
        SamplingParams(
            repetition_penalty=0.6, frequency_penalty=1.5, presence_penalty=0.3, logit_bias=((5, 3.0),)
        ),
        [1, 5, 12],
        [5, 12, 12, 30],
    ),
]


def test_processors_equal_the_reference_for_a_mixed_batch():
    logits = torch.randn(len(CASES), VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    history = TokenHistory(len(CASES) + 2, VOCAB, torch.device("cpu"))
    rows = torch.arange(1, len(CASES) + 1)
    for row, (_, prompt, outputs) in zip(rows.tolist(), CASES):
        history.start(row, prompt, outputs[:1])  # as after a prefill (a retracted request has outputs)
    for step in range(1, max(len(outputs) for _, _, outputs in CASES)):  # then sampled step by step
        tokens = [outputs[step] if step < len(outputs) else None for _, _, outputs in CASES]
        active = [i for i, token in enumerate(tokens) if token is not None]
        history.record(rows[active], torch.tensor([tokens[i] for i in active]))
    params = [p for p, _, _ in CASES]
    before = logits.clone()
    processed = Sampler(eos_token_ids=[EOS]).process(logits, params, history.rows(rows))
    assert torch.equal(logits, before)  # the caller's logits (a graph's output) are never written
    for index, (p, prompt, outputs) in enumerate(CASES):
        expected = torch.tensor(reference_process(logits[index].tolist(), p, prompt, outputs, EOS))
        torch.testing.assert_close(processed[index], expected, rtol=1e-6, atol=1e-5)


def test_greedy_rows_take_the_argmax_after_the_processors():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 1.0
    params = [SamplingParams(logit_bias=((9, 2.0),))]
    assert Sampler()(logits, params).tolist() == [9]


def test_min_tokens_holds_eos_back_until_reached_then_lets_it_through():
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, EOS] = 10.0
    history = TokenHistory(2, VOCAB, torch.device("cpu"))
    history.start(1, [3], [])
    params = [SamplingParams(min_tokens=2)]
    sampler, row = Sampler(eos_token_ids=[EOS]), torch.tensor([1])
    drawn = []
    for _ in range(3):
        token = sampler(logits, params, token_rows=history.rows(row))
        history.record(row, token)
        drawn.append(int(token))
    assert drawn[0] != EOS and drawn[1] != EOS and drawn[2] == EOS


def reference_min_p_support(logits: list[float], min_p: float) -> set[int]:
    peak = max(logits)
    weights = [math.exp(v - peak) for v in logits]
    return {i for i, w in enumerate(weights) if w >= min_p * max(weights)}


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_keeps_exactly_the_reference_support(min_p):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    kept = _min_p_filter(logits, torch.full((3,), min_p))
    for row in range(3):
        support = set(torch.isfinite(kept[row]).nonzero().flatten().tolist())
        assert support == reference_min_p_support(logits[row].tolist(), min_p)


def test_min_p_samples_stay_in_its_support():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    support = reference_min_p_support(logits[0].tolist(), 0.2)
    params = [SamplingParams(temperature=1.0, min_p=0.2)]
    draws = {int(Sampler()(logits, params)[0]) for _ in range(300)}
    assert draws <= support and len(draws) > 1


def test_a_batch_without_processors_pays_for_none(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a processor stage ran for a batch that asked for none")

    monkeypatch.setattr(Sampler, "process", fail)
    monkeypatch.setattr("snugkv.layers.sampler._min_p_filter", fail)
    logits = torch.randn(4, VOCAB)
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=5, top_p=0.9)] * 2
    Sampler()(logits, params)  # no token history given: none is needed


def test_penalties_without_a_token_history_are_an_error_not_ignored():
    with pytest.raises(ValueError, match="token history"):
        Sampler()(torch.zeros(1, VOCAB), [SamplingParams(presence_penalty=1.0)])


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be between -2 and 2"),
        ({"frequency_penalty": -3.0}, "frequency_penalty must be between -2 and 2"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 100]"),
        ({"min_p": 1.5}, "min_p must be between 0 and 1"),
        ({"min_tokens": 5, "max_new_tokens": 3}, "min_tokens=5 exceeds max_new_tokens=3"),
        ({"logit_bias": ((3, 101.0),)}, "between -100 and 100"),
    ],
)
def test_out_of_range_values_say_what_to_change(kwargs, words):
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(**kwargs)
    assert words in str(caught.value)


def test_logit_bias_names_only_tokens_of_the_vocabulary():
    with pytest.raises(InvalidRequest, match="not a token of this model"):
        SamplingParams(logit_bias=((VOCAB, 1.0),)).check_token_ids(VOCAB)


def test_the_structured_output_bitmask_comes_after_the_processors():
    """A bias toward a token the grammar forbids cannot bring it back: the mask is applied last."""
    from snugkv.core.structured_output import TokenBitmask

    logits = torch.zeros(2, VOCAB)
    bits = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    bits[0, 0] = (1 << 3) | (1 << 4)  # row 0 may take tokens 3 and 4 only
    mask = TokenBitmask(rows=torch.tensor([0]), bits=bits)
    params = [SamplingParams(logit_bias=((9, 100.0), (4, 1.0))), SamplingParams(logit_bias=((9, 100.0),))]
    assert Sampler()(logits, params, None, mask).tolist() == [4, 9]
