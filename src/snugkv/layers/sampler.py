"""Sampling the next token from float32 logits: greedy, temperature, top-k, top-p, per-request seeds.

Sampled rows use the exponential race: `argmax(probs / E)` with `E ~ Exp(1)` i.i.d. per token
draws exactly from `probs`, needs no normalisation after top-k/top-p masking and no host sync.
Whatever the values, the most likely token survives every filter, so a row can never be left with
nothing to draw from (a `top_p` of 1e-46 is 0 in float32 and would otherwise mask every token).
A request with a seed owns a `torch.Generator` (made by `SamplingParams.make_generator`) that
draws its noise, so its tokens do not depend on what else is in the batch. The per-row parameters
reach the device through pinned memory, so sampling never waits for the GPU's queue.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from snugkv.core.sampling import SamplingParams
from snugkv.core.structured_output import TokenBitmask
from snugkv.core.transfer import to_device
from snugkv.structured.bitmask import apply_token_bitmask


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        token_bitmask: TokenBitmask | None = None,
    ) -> torch.Tensor:
        """Next token ids `[B]` (int64) for logits `[B, vocab]`; `token_bitmask` holds the tokens
        structured output allows in its rows (the others are not constrained)."""
        if logits.shape[0] != len(params):
            raise ValueError(f"{logits.shape[0]} logit rows but {len(params)} sampling params")
        if token_bitmask is not None:
            logits = apply_token_bitmask(logits, token_bitmask)
        greedy_tokens = torch.argmax(logits, dim=-1)
        if all(p.greedy for p in params):
            return greedy_tokens
        device, vocab = logits.device, logits.shape[-1]
        temperatures = to_device(
            [p.temperature if not p.greedy else 1.0 for p in params], torch.float32, device
        )
        scaled = logits.float() / temperatures[:, None]
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if any(k < vocab for k in top_ks):
            scaled = _top_k_filter(scaled, to_device(top_ks, torch.int64, device))
        probs = torch.softmax(scaled, dim=-1)
        if any(p.top_p < 1 for p in params):
            probs = _top_p_filter(probs, to_device([p.top_p for p in params], torch.float32, device))
        noise = torch.empty_like(probs).exponential_()
        for row, generator in enumerate(generators or ()):
            if generator is not None:
                noise[row] = torch.empty(vocab, device=device).exponential_(generator=generator)
        # A draw of exactly 0 would make a masked token 0/0 = NaN, which argmax picks.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        sampled = torch.argmax(probs / noise, dim=-1)
        greedy = to_device([p.greedy for p in params], torch.bool, device)
        return torch.where(greedy, greedy_tokens, sampled)


def _top_k_filter(logits: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """Keep each row's `top_ks[row]` largest logits (ties at the threshold are kept)."""
    sorted_logits = torch.sort(logits, dim=-1, descending=True).values
    thresholds = sorted_logits.gather(1, (top_ks - 1)[:, None])
    return logits.masked_fill(logits < thresholds, float("-inf"))


def _top_p_filter(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches `top_ps[row]` (at least one)."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = mass_before >= top_ps[:, None]
    drop[:, 0] = False  # the most likely token: mass_before is 0 there, and a tiny top_p rounds to 0
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)
