"""Sampling the next token from float32 logits: a pipeline of logit processors, then the draw.

`Sampler.__call__` runs, in this order, only the stages some row of the batch asks for (a batch
where no row does pays for none of them, and the logits are not even copied):
1. `logit_bias`: `(token_id, bias)` pairs added to the logits;
2. penalties over the request's tokens (`TokenRows`, kept on the device by `token_history`):
   repetition (prompt and output tokens: positive logits divided, negative multiplied),
   frequency (times each output token's count) and presence (once per output token seen);
3. `min_tokens`: EOS and the request's `stop_token_ids` masked while fewer tokens are out;
4. structured output: `token_bitmask` sends every token a constrained row's grammar refuses to
   -inf (only the listed rows; a bias or penalty can never bring such a token back);
5. temperature; 6. `min_p`, top-k and top-p filters; 7. the draw (greedy rows: the argmax of the
   processed logits).
Stages 5-6 (`Sampler.weights`) and the draw (`exponential_race`) are also what speculative
verification (`snugkv.speculative.verify`) reads a row's distribution and its corrections from.

Sampled rows use the exponential race: `argmax(probs / E)` with `E ~ Exp(1)` i.i.d. per token
draws exactly from `probs`, needs no normalisation after top-k/top-p masking and no host sync.
Whatever the values, the most likely token survives every filter, so a row can never be left with
nothing to draw from (a `top_p` of 1e-46 is 0 in float32 and would otherwise mask every token).
A request with a seed owns a `torch.Generator` (made by `SamplingParams.make_generator`) that
draws its noise, so its tokens do not depend on what else is in the batch. The per-row parameters
reach the device through pinned memory, so sampling never waits for the GPU's queue. The caller's
logits are never written (they are a CUDA graph's output, and log-probabilities read them after).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from snugkv.core.sampling import SamplingParams
from snugkv.core.structured_output import TokenBitmask
from snugkv.core.transfer import to_device
from snugkv.structured.bitmask import apply_token_bitmask


@dataclass(frozen=True, slots=True)
class TokenRows:
    """What penalties and `min_tokens` read of each batch row's earlier tokens, on the device."""

    output_counts: torch.Tensor  # int32 [B, vocab]: how often each token was generated so far
    prompt_mask: torch.Tensor  # bool [B, vocab]: the token occurs in the prompt
    output_lens: torch.Tensor  # int64 [B]: tokens generated so far


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)  # what `min_tokens` holds back, with stop_token_ids

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        token_bitmask: TokenBitmask | None = None,
        token_rows: TokenRows | None = None,
    ) -> torch.Tensor:
        """Next token ids `[B]` (int64) for logits `[B, vocab]`; `token_rows` is needed when a row
        uses penalties or `min_tokens` (`SamplingParams.uses_token_history`); `token_bitmask` holds
        the tokens structured output allows in its rows (the others are not constrained)."""
        if logits.shape[0] != len(params):
            raise ValueError(f"{logits.shape[0]} logit rows but {len(params)} sampling params")
        if any(p.processes_logits for p in params):
            logits = self.process(logits, params, token_rows)
        if token_bitmask is not None:  # stage 4, before the greedy argmax too
            logits = apply_token_bitmask(logits, token_bitmask)
        greedy_tokens = torch.argmax(logits, dim=-1)
        if all(p.greedy for p in params):
            return greedy_tokens
        return self.draw(logits, params, generators, greedy_tokens)

    # -- logit processors (before the temperature) ----------------------------------------
    def process(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], token_rows: TokenRows | None
    ) -> torch.Tensor:
        """A processed copy of `logits`: bias, penalties, min_tokens (the module's stages 1-3)."""
        logits = logits.float().clone()
        if any(p.logit_bias for p in params):
            apply_logit_bias(logits, params)
        if any(p.uses_token_history for p in params):
            if token_rows is None:
                raise ValueError("penalties and min_tokens need the rows' token history (token_rows)")
            apply_penalties(logits, params, token_rows)
            if any(p.min_tokens for p in params):
                self.apply_min_tokens(logits, params, token_rows.output_lens)
        return logits

    def apply_min_tokens(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], output_lens: torch.Tensor
    ) -> None:
        """Mask EOS and `stop_token_ids` (in place) in rows with fewer than `min_tokens` out."""
        rows, tokens = [], []
        for row, p in enumerate(params):
            if p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                rows.extend([row] * len(stops))
                tokens.extend(sorted(stops))
        if not rows:
            return
        device = logits.device
        row_index, token_index = to_device(rows, torch.int64, device), to_device(tokens, torch.int64, device)
        min_tokens = to_device([p.min_tokens for p in params], torch.int64, device)
        held = (output_lens < min_tokens)[row_index]
        current = logits[row_index, token_index]
        logits[row_index, token_index] = torch.where(held, float("-inf"), current)

    # -- the draw (after the temperature) ---------------------------------------------------
    def draw(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None,
        greedy_tokens: torch.Tensor,
    ) -> torch.Tensor:
        sampled = exponential_race(self.weights(logits, params), generators)
        greedy = to_device([p.greedy for p in params], torch.bool, logits.device)
        return torch.where(greedy, greedy_tokens, sampled)

    def weights(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Float32 `[B, vocab]` weights proportional to each row's sampling distribution: the
        softmax of the tempered logits after `min_p` and top-k, with what top-p drops set to 0
        (stages 5-6). Not renormalised after top-p (the race needs no normalisation); divide by
        the row's sum for probabilities. Greedy rows are computed at temperature 1 (unused)."""
        device, vocab = logits.device, logits.shape[-1]
        temperatures = to_device(
            [p.temperature if not p.greedy else 1.0 for p in params], torch.float32, device
        )
        scaled = logits.float() / temperatures[:, None]
        if any(p.min_p > 0 for p in params):
            scaled = _min_p_filter(scaled, to_device([p.min_p for p in params], torch.float32, device))
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if any(k < vocab for k in top_ks):
            scaled = _top_k_filter(scaled, to_device(top_ks, torch.int64, device))
        probs = torch.softmax(scaled, dim=-1)
        if any(p.top_p < 1 for p in params):
            probs = _top_p_filter(probs, to_device([p.top_p for p in params], torch.float32, device))
        return probs


def exponential_race(
    weights: torch.Tensor, generators: Sequence[torch.Generator | None] | None = None
) -> torch.Tensor:
    """One token per row of `weights` `[B, vocab]` (non-negative, each row with some mass), drawn
    with probability proportional to its weight: `argmax(weights / E)`, `E ~ Exp(1)`; row `i`'s
    noise comes from `generators[i]` where it has one."""
    vocab, device = weights.shape[-1], weights.device
    noise = torch.empty_like(weights).exponential_()
    for row, generator in enumerate(generators or ()):
        if generator is not None:
            noise[row] = torch.empty(vocab, device=device).exponential_(generator=generator)
    # A draw of exactly 0 would make a masked token 0/0 = NaN, which argmax picks.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return torch.argmax(weights / noise, dim=-1)


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Add each row's `logit_bias` to its logits (in place; ids were checked against the vocabulary)."""
    rows = [row for row, p in enumerate(params) for _ in p.logit_bias]
    tokens = [token for p in params for token, _ in p.logit_bias]
    biases = [bias for p in params for _, bias in p.logit_bias]
    device = logits.device
    flat = to_device(rows, torch.int64, device) * logits.shape[-1] + to_device(tokens, torch.int64, device)
    logits.view(-1).index_add_(0, flat, to_device(biases, torch.float32, device))


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], token_rows: TokenRows) -> None:
    """Repetition, frequency and presence penalties, in place, for the whole batch at once (rows
    without them have repetition 1 and the others 0, which leaves their logits as they are)."""
    device = logits.device
    counts = token_rows.output_counts
    if any(p.repetition_penalty != 1.0 for p in params):
        repetition = to_device([p.repetition_penalty for p in params], torch.float32, device)[:, None]
        seen = token_rows.prompt_mask | (counts > 0)
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits.copy_(torch.where(seen, penalised, logits))
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        frequency = to_device([p.frequency_penalty for p in params], torch.float32, device)[:, None]
        presence = to_device([p.presence_penalty for p in params], torch.float32, device)[:, None]
        logits.sub_(frequency * counts + presence * (counts > 0))


def _min_p_filter(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below `min_ps[row]` times the row's most likely one's."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


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
