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


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_p=1e-46),  # 0 in float32
        SamplingParams(temperature=100.0, top_p=1e-46),
        SamplingParams(temperature=1e-46),
        SamplingParams(temperature=1e-30, top_p=0.5, top_k=3),
        SamplingParams(temperature=100.0, top_k=1),
    ],
    ids=["tiny-top-p", "hot-tiny-top-p", "tiny-temperature", "cold-top-p-top-k", "hot-top-k-1"],
)
def test_extreme_sampling_values_draw_the_most_likely_token(params):
    logits = _logits()
    for _ in range(10):
        assert Sampler()(logits, [params] * 4).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_p", [1e-46, 1e-9, 0.3, 1.0])
def test_top_p_always_keeps_the_argmax(top_p):
    from snugkv.layers.sampler import _top_p_filter

    probs = torch.softmax(_logits(rows=8) * 5, dim=-1)
    kept = _top_p_filter(probs, torch.full((8,), top_p))
    assert (kept.gather(1, probs.argmax(-1, keepdim=True)) > 0).all()


def test_top_k_always_keeps_the_argmax():
    from snugkv.layers.sampler import _top_k_filter

    logits = _logits(rows=8)
    for k in (1, 2, VOCAB):
        kept = _top_k_filter(logits, torch.full((8,), k))
        assert torch.isfinite(kept.gather(1, logits.argmax(-1, keepdim=True))).all()


def test_a_zero_noise_draw_never_picks_a_masked_token(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, *args, **kwargs: self.zero_())
    logits = _logits()
    tokens = Sampler()(logits, [SamplingParams(temperature=1.0, top_k=2)] * 4)
    allowed = torch.topk(logits, 2).indices
    assert all(int(t) in allowed[row].tolist() for row, t in enumerate(tokens))
