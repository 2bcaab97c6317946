"""Tokens a step sampled that the host has not read yet: the inputs of the next decode step.

With overlapped scheduling the host launches decode step N+1 before step N's tokens reach it. A
row of step N+1 whose input is still on the device carries `FUTURE_TOKEN` (snugkv.core.forward).
Step N's sampler stored each request's token at the request's row of the request-to-token table
(`store`); before step N+1's forward the runner swaps the placeholders for those tokens
(`resolve`): a gather on the device, outside any CUDA graph (a graph copies the resolved ids into
its static input). One entry per table row suffices: a request keeps its row while it runs and
each of its steps stores one token, and steps run in stream order, so step N's store comes before
step N+1's read, and a row handed to a new request is written by that request's prefill first.
"""

from __future__ import annotations

import torch


class FutureTokens:
    def __init__(self, num_rows: int, device: torch.device) -> None:
        self.tokens = torch.zeros(num_rows, dtype=torch.int64, device=device)

    def store(self, req_pool_indices: torch.Tensor, tokens: torch.Tensor) -> None:
        """`tokens[i]` is the token just sampled for the request in row `req_pool_indices[i]`."""
        self.tokens[req_pool_indices] = tokens

    def resolve(self, input_ids: torch.Tensor, req_pool_indices: torch.Tensor) -> torch.Tensor:
        """A batch's input ids with every placeholder (< 0) replaced by its row's token. The first
        `len(req_pool_indices)` ids are decode rows' (one token each, in row order: a decode batch,
        or the leading rows of a mixed step); the ids after them are never placeholders."""
        rows = req_pool_indices.numel()
        head = input_ids[:rows]
        resolved = torch.where(head < 0, self.tokens[req_pool_indices], head)
        return resolved if rows == input_ids.numel() else torch.cat([resolved, input_ids[rows:]])
