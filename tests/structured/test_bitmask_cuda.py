"""The token bitmask on the GPU: the sampler masks the constrained rows on the device exactly as on
the CPU (and as xgrammar's own kernel does), greedy and sampled rows pick only allowed tokens, and
other rows are untouched."""

from __future__ import annotations

import pytest
import torch

from snugkv.core.sampling import SamplingParams
from snugkv.core.structured_output import TokenBitmask
from snugkv.layers.sampler import Sampler
from snugkv.structured.bitmask import apply_token_bitmask, bitmask_words, unpack_bitmask

VOCAB = 151936  # Qwen's vocabulary (a multiple of 32); the other case below is not


def random_mask(rows: list[int], vocab: int, device: torch.device, density: float) -> TokenBitmask:
    generator = torch.Generator().manual_seed(len(rows))
    allowed = torch.rand(len(rows), bitmask_words(vocab) * 32, generator=generator) < density
    weights = (1 << torch.arange(32, dtype=torch.int64)).view(1, 1, 32)
    words = (allowed.view(len(rows), -1, 32).long() * weights).sum(-1)
    bits = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return TokenBitmask(torch.tensor(rows, device=device), bits.to(device))


@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [VOCAB, 49152 + 7])
def test_the_mask_on_the_gpu_matches_the_cpu_and_xgrammar(vocab: int) -> None:
    cuda = torch.device("cuda")
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(0))
    mask = random_mask(list(range(0, 64, 4)), vocab, cuda, density=0.01)
    on_gpu = apply_token_bitmask(logits.to(cuda), mask).cpu()
    cpu_mask = TokenBitmask(mask.rows.cpu(), mask.bits.cpu())
    assert torch.equal(on_gpu, apply_token_bitmask(logits, cpu_mask))
    untouched = [row for row in range(64) if row % 4]
    assert torch.equal(on_gpu[untouched], logits[untouched])
    xgr = pytest.importorskip("xgrammar")
    reference = logits.to(cuda)
    full_bits = torch.full((64, mask.bits.shape[1]), -1, dtype=torch.int32, device=cuda)
    full_bits[mask.rows] = mask.bits  # xgrammar's rows are the batch's rows
    xgr.apply_token_bitmask_inplace(reference, full_bits, indices=mask.rows.tolist())
    assert torch.equal(reference.cpu(), on_gpu)


@pytest.mark.cuda
def test_the_sampler_picks_only_allowed_tokens_on_the_gpu() -> None:
    cuda = torch.device("cuda")
    rows = list(range(0, 64, 4))
    mask = random_mask(rows, VOCAB, cuda, density=0.001)
    allowed = unpack_bitmask(mask.bits, VOCAB)
    logits = torch.randn(64, VOCAB, device=cuda)
    params = [SamplingParams(temperature=0.0 if i % 8 else 0.8, top_p=0.9) for i in range(64)]
    for _ in range(5):
        tokens = Sampler()(logits, params, None, mask)
        picked = tokens[mask.rows]
        assert bool(allowed[torch.arange(len(rows), device=cuda), picked].all())
    free = [row for row in range(64) if row % 4 and row % 8]
    assert torch.equal(tokens[free], logits[free].argmax(-1))
