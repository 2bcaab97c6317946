"""Sampling: greedy is argmax, filters restrict the support, seeds make requests reproducible."""

from __future__ import annotations

import pytest
import torch

from snugkv.core.sampling import SamplingParams
from snugkv.layers.sampler import Sampler

VOCAB = 50


def _logits(rows: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax_even_in_a_sampled_batch():
    logits = _logits()
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0),
        SamplingParams(),
        SamplingParams(temperature=0.7),
    ]
    tokens = Sampler()(logits, params)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_top_k_one_is_greedy():
    logits = _logits()
    tokens = Sampler()(logits, [SamplingParams(temperature=2.0, top_k=1)] * 4)
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_tiny_top_p_keeps_only_the_most_likely_token():
    logits = _logits()
    tokens = Sampler()(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 4)
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_top_k_samples_stay_within_the_k_best():
    logits = _logits(rows=1)
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    draws = {int(Sampler()(logits, [SamplingParams(temperature=5.0, top_k=5)])[0]) for _ in range(200)}
    assert draws <= allowed and len(draws) > 1


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    generator = SamplingParams(temperature=1.0, seed=3).make_generator(torch.device("cpu"))
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[int(Sampler()(logits, [SamplingParams(temperature=1.0)], [generator])[0])] += 1
    torch.testing.assert_close(counts / counts.sum(), torch.tensor([0.7, 0.2, 0.1]), atol=0.03, rtol=0)


def test_a_seeded_request_draws_the_same_tokens_whatever_else_is_in_the_batch():
    logits = _logits(rows=3)
    seeded = SamplingParams(temperature=1.0, seed=42)

    def run(batch_logits, params):
        generators = [p.make_generator(torch.device("cpu")) for p in params]
        return [int(Sampler()(batch_logits, params, generators)[0]) for _ in range(6)]

    alone = run(logits[:1], [seeded])
    crowded = run(logits, [seeded, SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, seed=7)])
    assert alone == crowded


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_invalid_sampling_params_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
