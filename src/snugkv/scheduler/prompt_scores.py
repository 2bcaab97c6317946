"""The log-probabilities of a prompt's own tokens (OpenAI's `echo` with `logprobs`, vLLM's
`prompt_logprobs`), from the logits a prefill returns for every position of a scoring row.

A row with `BatchRow.prompt_logits` gets the logits of all its new tokens; the logits at position
j score prompt token j + 1, and those at the prompt's last position are the ones sampled.
`split_logits` separates the rows the sampler takes from the rows that score the prompt and
queues the scoring on the device (log-softmax, the prompt token's value and rank, the top
alternatives) with the results on their way to the host; `PromptScores.add_to_requests` turns
them into `TokenLogprob`s once the step is read. Only scoring rows pay: other rows' logits are
never computed beyond their last token. Each request's prompt is scored from position 0 (its
prefix-cache match is skipped, `Request.scores_prompt`), so entries arrive in position order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from snugkv.core.forward import BatchRow
from snugkv.core.outputs import TokenLogprob
from snugkv.core.transfer import to_device, to_host
from snugkv.layers.logprobs import score_tokens
from snugkv.scheduler.request import Request


@dataclass(frozen=True, slots=True)
class ScoredSpan:
    request: Request
    first_position: int  # the prompt position of this span's first scored token
    count: int


@dataclass(frozen=True, slots=True)
class PromptScores:
    """Host-bound results for the scored prompt tokens of one step, span after span."""

    spans: list[ScoredSpan]
    target_ids: list[int]
    logprobs: torch.Tensor  # float32 [n]: each prompt token's log-probability
    ranks: torch.Tensor  # int64 [n]: its place among all tokens (1: the most likely)
    top_values: torch.Tensor  # float32 [n, k]
    top_ids: torch.Tensor  # int64 [n, k]

    def add_to_requests(self, piece: Callable[[int], str]) -> None:
        """Append each span's entries to its request's `prompt_logprobs` (read after the step's
        event; a request that ended meanwhile is skipped)."""
        logprobs, ranks = self.logprobs.tolist(), self.ranks.tolist()
        top_values, top_ids = self.top_values.tolist(), self.top_ids.tolist()
        offset = 0
        for span in self.spans:
            request = span.request
            for index in range(offset, offset + span.count):
                position = span.first_position + index - offset
                if request.finished or position != len(request.prompt_logprobs):
                    continue
                top_n = request.sampling.prompt_logprobs or 0
                token_id = self.target_ids[index]
                request.prompt_logprobs.append(
                    TokenLogprob(
                        token_id=token_id,
                        token=piece(token_id),
                        logprob=logprobs[index],
                        top=[
                            (piece(t), v) for t, v in zip(top_ids[index][:top_n], top_values[index][:top_n])
                        ],
                        top_ids=tuple(top_ids[index][:top_n]),
                        rank=ranks[index],
                    )
                )
            offset += span.count


def split_logits(
    logits: torch.Tensor, rows: Sequence[BatchRow], requests: Sequence[Request]
) -> tuple[torch.Tensor, PromptScores | None]:
    """The logits rows to sample (one per row with `need_logits`, in row order) and, when a row
    scores its prompt, that scoring queued on the device."""
    if not any(row.prompt_logits for row in rows):
        return logits, None
    sampled: list[int] = []
    scored: list[int] = []
    targets: list[int] = []
    spans: list[ScoredSpan] = []
    offset = 0
    for row, request in zip(rows, requests):
        count = len(row.token_ids) if row.prompt_logits else int(row.need_logits)
        if row.need_logits:
            sampled.append(offset + count - 1)
        if row.prompt_logits:
            first = row.prefix_len  # logits at position j score prompt token j + 1
            end = min(row.seq_len, len(request.prompt_ids) - 1)
            if end > first:
                scored.extend(range(offset, offset + end - first))
                targets.extend(request.prompt_ids[first + 1 : end + 1])
                spans.append(ScoredSpan(request, first + 1, end - first))
        offset += count
    device = logits.device
    sample_logits = logits.index_select(0, to_device(sampled, torch.int64, device))
    if not scored:
        return sample_logits, None
    top_n = max((span.request.sampling.prompt_logprobs or 0) for span in spans)
    scored_logits = logits.index_select(0, to_device(scored, torch.int64, device))
    scored_tokens = score_tokens(scored_logits, to_device(targets, torch.int64, device), top_n)
    scores = PromptScores(
        spans=spans,
        target_ids=targets,
        logprobs=to_host(scored_tokens.logprobs),
        ranks=to_host(scored_tokens.ranks),
        top_values=to_host(scored_tokens.top_values),
        top_ids=to_host(scored_tokens.top_ids),
    )
    return sample_logits, scores
