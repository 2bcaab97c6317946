"""Log-probabilities of given tokens under float32 logits: the token's value, its rank, the top-n."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenScores:
    logprobs: torch.Tensor  # float32 [n]: each target token's log-probability
    ranks: torch.Tensor  # int64 [n]: its place among all tokens (1: the most likely)
    top_values: torch.Tensor  # float32 [n, top_n]
    top_ids: torch.Tensor  # int64 [n, top_n]


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, top_n: int) -> TokenScores:
    """Scores of `targets [n]` under `logits [n, vocab]` (queued on the device, no host sync)."""
    log_probs = torch.log_softmax(logits.float(), -1)
    chosen = log_probs.gather(1, targets[:, None])
    ranks = (log_probs > chosen).sum(dim=-1) + 1
    top = torch.topk(log_probs, top_n, dim=-1)
    return TokenScores(chosen[:, 0], ranks, top.values, top.indices)
