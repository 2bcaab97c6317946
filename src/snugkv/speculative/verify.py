"""Verification: how many of each row's drafted tokens the target model keeps, and the token after.

Owns the acceptance rule and the random draws it needs, for a batch of rows each with a draft of
its own length. It never runs a model, never proposes, never touches the KV cache (rolling back
the KV of rejected tokens is the caller's), and never writes the logits it is given.

Layout: for a row with drafted tokens `x_0 .. x_{k-1}`, a verify step computes the target's logits
at `k + 1` positions: after the row's last accepted token (its distribution `p_0` judges `x_0`),
after `x_0` (`p_1` judges `x_1`), ..., after `x_{k-1}` (`p_k`, for the bonus token). `logits` holds
every row's `k + 1` positions, row after row (a forward batch's order of new tokens); a row with
`k = 0` is plain sampling.

The rule is speculative sampling (Leviathan, Kalman and Matias, arXiv:2211.17192; Chen et al.,
arXiv:2302.01318), with `p_j` the target's distribution after the row's sampling and `q_j` the
draft's:
- `x_j` is accepted with probability `min(1, p_j(x_j) / q_j(x_j))`, in order, until the first
  rejection;
- at the first rejected position `j` the row's next token is drawn from
  `normalize(max(p_j - q_j, 0))`; when all `k` are accepted it is drawn from `p_k`.
A row emits its accepted tokens plus that one (1 to `k + 1` tokens), and each is distributed exactly
as the target's: `P(y) = min(p, q)(y) + (1 - sum(min(p, q))) * residual(y) = p(y)`.
- A draft without probabilities (n-gram, suffix: `draft_probs=None`) is a point mass,
  `q_j(x_j) = 1`: `x_j` is accepted with probability `p_j(x_j)`, and the residual is `p_j` without
  `x_j`, renormalised.
- A greedy row's `p_j` is the point mass on its argmax, so the rule keeps `x_j` while it is the
  argmax, then emits the argmax: no random draw decides anything, and the tokens are those of
  decoding without speculation.

`p_j` is the sampler's (snugkv.layers.sampler), not a copy of it: stages 1-3 through
`Sampler.process`, with the token history each position would have had (position `j` of a row has
also generated `x_0 .. x_{j-1}`: penalties and `min_tokens` see what plain decoding would see);
stage 4 through a `TokenBitmask` over positions, which the caller fills by advancing the row's
grammar over its draft; stages 5-6 through `Sampler.weights`; the draws through `exponential_race`.

Randomness: each row draws its `k` uniforms, then one race over the vocabulary, from its own
generator when seeded (reproducible whatever else is in the batch), else from torch's default. A
seeded request is reproducible under speculation but not token-identical to the same seed without
it (the stream is used differently); its distribution is the same. Nothing waits for the device
but `Verification.token_lists`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from snugkv.core.sampling import SamplingParams
from snugkv.core.structured_output import TokenBitmask
from snugkv.core.transfer import to_device
from snugkv.layers.sampler import Sampler, TokenRows, exponential_race
from snugkv.structured.bitmask import apply_token_bitmask


@dataclass(frozen=True, slots=True)
class Verification:
    """What a verify step keeps, on the logits' device."""

    accepted_lens: torch.Tensor  # int64 [B]: drafted tokens each row keeps
    token_ids: torch.Tensor  # int64 [B, max k + 1]: the kept drafted tokens, the drawn one, then -1

    @property
    def emitted_lens(self) -> torch.Tensor:
        """Tokens each row emits: its accepted drafted tokens and the one drawn after them."""
        return self.accepted_lens + 1

    def token_lists(self) -> list[list[int]]:
        """Each row's emitted tokens, on the host (waits for the device)."""
        lens = self.emitted_lens.tolist()
        return [row[:count] for row, count in zip(self.token_ids.tolist(), lens)]


def verify(
    logits: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    *,
    sampler: Sampler,
    generators: Sequence[torch.Generator | None] | None = None,
    draft_probs: torch.Tensor | None = None,
    token_rows: TokenRows | None = None,
    token_bitmask: TokenBitmask | None = None,
) -> Verification:
    """Verify each row's draft against the target's `logits` `[sum(k_i + 1), vocab]` (float32, the
    layout of the module docstring). `draft_probs` `[sum(k_i), vocab]`: the draft's distribution at
    each drafted token (None: point masses); `token_rows`: each row's history before the draft (rows
    with penalties or `min_tokens`); `token_bitmask`: its rows index positions of `logits`."""
    draft_lens = [len(draft) for draft in draft_token_ids]
    _check_shapes(logits, draft_token_ids, params, generators, draft_probs, token_rows)
    position_params = [p for p, k in zip(params, draft_lens) for _ in range(k + 1)]
    processed = logits
    if any(p.processes_logits for p in params):
        history = None if token_rows is None else position_token_rows(token_rows, draft_token_ids)
        processed = sampler.process(logits, position_params, history)
    if token_bitmask is not None:
        processed = apply_token_bitmask(processed, token_bitmask)
    device, width = logits.device, max(draft_lens, default=0)
    padded = [token for draft in draft_token_ids for token in (*draft, *[0] * (width - len(draft)))]
    drafts = to_device(padded, torch.int64, device).reshape(len(params), width)
    lens = to_device(draft_lens, torch.int64, device)
    if all(p.greedy for p in params):  # no draws: the argmax decides (a few ops, not ~30)
        return greedy_verification(torch.argmax(processed, dim=-1), drafts, lens)
    target_probs = target_probabilities(processed, position_params, sampler)
    uniforms = _uniforms(draft_lens, width, generators, device)
    return rejection_sample(target_probs, drafts, lens, draft_probs, uniforms, generators)


def target_probabilities(
    processed_logits: torch.Tensor, params: Sequence[SamplingParams], sampler: Sampler
) -> torch.Tensor:
    """Float32 `[N, vocab]` probabilities of each position's target distribution, from logits after
    stages 1-4: the sampler's weights renormalised, and the point mass on the argmax for greedy rows."""
    greedy_rows = [row for row, p in enumerate(params) if p.greedy]
    if len(greedy_rows) == len(params):
        return _point_masses(processed_logits)
    weights = sampler.weights(processed_logits, params)
    probs = weights / weights.sum(dim=-1, keepdim=True)
    if greedy_rows:
        index = to_device(greedy_rows, torch.int64, processed_logits.device)
        probs[index] = _point_masses(processed_logits[index])
    return probs


def _point_masses(logits: torch.Tensor) -> torch.Tensor:
    """Float32 one-hot rows on each row's argmax (the greedy draw's token)."""
    masses = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return masses.scatter_(1, torch.argmax(logits, dim=-1, keepdim=True), 1.0)


def greedy_verification(
    targets: torch.Tensor, draft_token_ids: torch.Tensor, draft_lens: torch.Tensor
) -> Verification:
    """The rule for a batch of greedy rows, from each position's argmax `targets` `[sum(k_i + 1)]`:
    a row keeps its drafted tokens while each equals the argmax before it, then emits the argmax
    (what `rejection_sample` gives with point masses, without a vocabulary-wide tensor or a draw)."""
    width = draft_token_ids.shape[1]
    device = targets.device
    row_starts = torch.cumsum(draft_lens + 1, dim=0) - (draft_lens + 1)
    offsets = torch.arange(width + 1, device=device)
    positions = (row_starts[:, None] + offsets[None, :]).clamp_max(targets.shape[0] - 1)
    argmaxes = targets[positions]  # [B, K + 1]: each position's greedy token
    drafted = offsets[None, :width] < draft_lens[:, None]
    accepted = (argmaxes[:, :width] == draft_token_ids) & drafted
    accepted_lens = accepted.long().cumprod(dim=1).sum(dim=1)
    # kept drafted tokens equal the argmax at their positions: the emitted tokens are the argmaxes
    token_ids = torch.where(offsets[None, :] <= accepted_lens[:, None], argmaxes, -1)
    return Verification(accepted_lens=accepted_lens, token_ids=token_ids)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_lens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    generators: Sequence[torch.Generator | None] | None = None,
) -> Verification:
    """The rule on tensors: `target_probs` `[sum(k_i + 1), vocab]` (each row sums to 1),
    `draft_token_ids` `[B, K]` int64 (row `i`'s first `draft_lens[i]` are its draft, the rest
    ignored), `draft_probs` `[sum(k_i), vocab]` or None (point masses), `uniforms` `[B, K]` in [0, 1)."""
    rows, width = draft_token_ids.shape
    device = target_probs.device
    row_starts = torch.cumsum(draft_lens + 1, dim=0) - (draft_lens + 1)
    offsets = torch.arange(width, device=device)
    drafted = offsets[None, :] < draft_lens[:, None]
    # Padding entries point at a later row's position (or are clamped): read, then masked out.
    positions = (row_starts[:, None] + offsets[None, :]).clamp_max(target_probs.shape[0] - 1)
    p_drafted = target_probs[positions, draft_token_ids]
    if draft_probs is None:
        q_drafted = torch.ones_like(p_drafted)
    else:
        draft_probs = draft_probs.float()
        draft_starts = torch.cumsum(draft_lens, dim=0) - draft_lens
        draft_positions = (draft_starts[:, None] + offsets[None, :]).clamp_max(
            max(draft_probs.shape[0] - 1, 0)
        )
        q_drafted = draft_probs[draft_positions, draft_token_ids]
    # u < p/q without dividing: a greedy row's p(x) is exactly 0 or 1, which u * q never reaches
    accepted = (uniforms * q_drafted < p_drafted) & drafted
    accepted_lens = accepted.long().cumprod(dim=1).sum(dim=1)
    p_next = target_probs[row_starts + accepted_lens]
    if width == 0:
        residual = p_next
    else:
        rejected = (accepted_lens < draft_lens)[:, None]
        at = accepted_lens.clamp_max(width - 1)[:, None]
        if draft_probs is None:
            rejected_token = draft_token_ids.gather(1, at)
            kept = torch.where(rejected, 0.0, p_next.gather(1, rejected_token))
            residual = p_next.scatter(1, rejected_token, kept)
        else:
            q_next = draft_probs[(draft_starts + at.squeeze(1)).clamp_max(draft_probs.shape[0] - 1)]
            residual = (p_next - q_next * rejected).clamp_min(0.0)
        # A rejection leaves mass to draw from; only rounding can empty it, then p itself is right.
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_next)
    next_tokens = exponential_race(residual, generators)
    columns = torch.arange(width + 1, device=device)[None, :]
    kept_lens = accepted_lens[:, None]
    drafts_and_one = torch.cat([draft_token_ids, draft_token_ids.new_zeros(rows, 1)], dim=1)
    token_ids = torch.where(
        columns < kept_lens,
        drafts_and_one,
        torch.where(columns == kept_lens, next_tokens[:, None], torch.full_like(drafts_and_one, -1)),
    )
    return Verification(accepted_lens=accepted_lens, token_ids=token_ids)


def position_token_rows(token_rows: TokenRows, draft_token_ids: Sequence[Sequence[int]]) -> TokenRows:
    """Each verify position's token history: its row's, plus the row's drafted tokens before it
    (position `j` of a row has generated `j` more tokens: `x_0 .. x_{j-1}`)."""
    counts = token_rows.output_counts
    device = counts.device
    rows = [row for row, draft in enumerate(draft_token_ids) for _ in range(len(draft) + 1)]
    generated = [j for draft in draft_token_ids for j in range(len(draft) + 1)]
    index = to_device(rows, torch.int64, device)
    position_counts = counts[index]
    positions: list[int] = []
    tokens: list[int] = []
    start = 0
    for draft in draft_token_ids:
        for j in range(1, len(draft) + 1):
            positions.extend([start + j] * j)
            tokens.extend(draft[:j])
        start += len(draft) + 1
    if positions:
        position_counts.index_put_(
            (to_device(positions, torch.int64, device), to_device(tokens, torch.int64, device)),
            torch.ones(len(positions), dtype=counts.dtype, device=device),
            accumulate=True,
        )
    return TokenRows(
        output_counts=position_counts,
        prompt_mask=token_rows.prompt_mask[index],
        output_lens=token_rows.output_lens[index] + to_device(generated, torch.int64, device),
    )


def _uniforms(
    draft_lens: Sequence[int],
    width: int,
    generators: Sequence[torch.Generator | None] | None,
    device: torch.device,
) -> torch.Tensor:
    """`[B, width]` uniforms; a seeded row draws only its own `k` from its generator, so what it
    takes from its stream does not depend on the other rows' drafts."""
    uniforms = torch.rand(len(draft_lens), width, device=device)
    for row, generator in enumerate(generators or ()):
        if generator is not None and draft_lens[row]:
            uniforms[row, : draft_lens[row]] = torch.rand(draft_lens[row], device=device, generator=generator)
    return uniforms


def _check_shapes(
    logits: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None,
    draft_probs: torch.Tensor | None,
    token_rows: TokenRows | None,
) -> None:
    rows, vocab = len(params), logits.shape[-1]
    if len(draft_token_ids) != rows:
        raise ValueError(f"{len(draft_token_ids)} drafts but {rows} sampling params: one of each per row")
    if generators is not None and len(generators) != rows:
        raise ValueError(f"{len(generators)} generators for {rows} rows: one per row (None where unseeded)")
    drafted = sum(len(draft) for draft in draft_token_ids)
    if logits.shape[0] != drafted + rows:
        raise ValueError(
            f"{logits.shape[0]} logit rows for {rows} rows drafting {drafted} tokens: a verify step "
            f"has k + 1 positions per row, {drafted + rows} in all"
        )
    if draft_probs is not None and tuple(draft_probs.shape) != (drafted, vocab):
        raise ValueError(
            f"draft_probs has shape {tuple(draft_probs.shape)}; it needs one row per drafted token: "
            f"({drafted}, {vocab})"
        )
    if token_rows is not None and token_rows.output_counts.shape[0] != rows:
        raise ValueError(f"token_rows has {token_rows.output_counts.shape[0]} rows for {rows} rows")
    for row, draft in enumerate(draft_token_ids):
        if any(not 0 <= token < vocab for token in draft):
            raise ValueError(f"row {row} drafts a token outside the vocabulary of {vocab}: {list(draft)}")
